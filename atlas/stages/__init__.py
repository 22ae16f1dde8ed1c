"""All pipeline stages, in pipeline order. Each stage is one module with one class."""

from atlas.stages.annotate import AnnotateStage
from atlas.stages.chunk import ChunkStage
from atlas.stages.cluster import ClusterStage
from atlas.stages.coherence import CoherenceStage
from atlas.stages.index import IndexStage
from atlas.stages.label import LabelStage
from atlas.stages.library import LibraryStage
from atlas.stages.tag import TagStage
from atlas.stages.targets import TargetsStage
from atlas.stages.tokenize import TokenizeStage
from atlas.stages.train_annotator import TrainAnnotatorStage
from atlas.stages.vocab import VocabStage

STAGES = {
    stage.name: stage
    for stage in (ChunkStage, TagStage, VocabStage, ClusterStage, CoherenceStage, LabelStage, LibraryStage,
                  TargetsStage, TrainAnnotatorStage, AnnotateStage, TokenizeStage, IndexStage)
}

# The stages that build the library and train the annotator from the tagged sample. A run with
# annotate.annotator_from uses another run's annotator and runs none of them.
LIBRARY_STAGES = ("tag", "vocab", "cluster", "coherence", "label", "library", "targets", "train_annotator")
