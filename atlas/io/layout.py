"""The run directory's folder names: one constant per output folder, used by every writer and reader.

    RUN/chunks/ tags/ tag_vocab/ clusters/ coherence/ labels/ library/ targets/ annotator/
        annotated/ embeddings.zarr/ tokens/ index/          stage outputs (see README, "The run directory")
    RUN/cblm/<name>/                                         concept-bottleneck LMs trained on the run
    RUN/report/                                              the HTML report, plots, judge and eval summaries
    RUN/_cache/                                              engine answers and embeddings, reused on resume
    RUN/_tmp/<stage>/                                        what a global stage spills to disk (removed after it)
"""

CHUNKS = "chunks"
TAGS = "tags"
TAG_VOCAB = "tag_vocab"
CLUSTERS = "clusters"
CLUSTER_CENTROIDS = "_centroids.npy"  # in clusters/: each cluster's mean tag embedding
CLUSTER_VECTORS = "_vectors.npy"  # in clusters/: what k-means fit, read by coherence (see atlas/stages/cluster.py)
CLUSTER_JOINED_CENTROIDS = "_joined_centroids.npy"  # in clusters/: k-means' centroids in that space, read by library
LIBRARY_NEAR_VOTES = "near_votes.parquet"  # in library/: near concepts read in each chunk (with contexts)
COHERENCE = "coherence"
LABELS = "labels"
LIBRARY = "library"
TARGETS = "targets"
ANNOTATOR = "annotator"
ANNOTATED = "annotated"
EMBEDDINGS = "embeddings.zarr"
TOKENS = "tokens"
INDEX = "index"
CBLM = "cblm"
REPORT = "report"
CACHE = "_cache"
TMP = "_tmp"
