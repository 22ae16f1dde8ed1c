"""The offline engine: real algorithms on a small embedding model, no LLM, no GPU, no network.

It answers the same requests as the LLM engines, with JSON that follows the request's schema, so
its output goes through the same validation and accounting. It reads ``request.context``:

- ``task="tag"``: fields marked ``"x-atlas-offline": {"method": "keyphrases"}`` in the domain
  schema get KeyBERT-style keyphrases: candidate noun phrases of 1-3 words within one clause
  (``candidate_phrases``: stopwords, number words, words that can only be verbs or adverbs, and words the
  part-of-speech tagger reads as verbs, adverbs or function words in their sentence end a phrase; the
  head is singular; a news wire's credit ("NEW YORK (Reuters) - ") and a company's legal form ("corp", "inc") are
  left out; for code, identifiers are split into words, and doctest examples with their expected
  output, docstring markup, Python's exception classes and its plumbing builtins are left out), ranked
  by embedding similarity to the chunk, and picked with maximal marginal relevance (MMR) so they do not
  repeat each other. Several keyphrase fields share one MMR ranking in schema order (e.g. "main" takes the
  most central phrases, "minor" the next ones). Fields marked ``{"method": "candidates", "list":
  NAME}`` get an entry of the finite list ``schemas/candidates/NAME.json`` only when it clearly
  stands out for the chunk (``clear_candidates``), else nothing: a fixed-list answer that is merely
  the least bad entry ("field: zoology" for Python decorators) is worse than none. Fields marked
  ``{"method": "imports"}`` get the modules a chunk of code imports (``imported_modules``).
- ``task="judge"``: relevance of each concept to a chunk from 1 to 5, from their cosine
  similarity. This is a proxy for the LLM judge and is reported as one.

All embeddings of a batch are computed together in a fixed order, so the same batch always gives
the same answer (resumed shards reproduce their outputs exactly).
"""

from __future__ import annotations

import builtins
import json
import pickle
import re
from collections import Counter
from functools import lru_cache

import numpy as np

from atlas.config import LLMConfig
from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult
from atlas.models.embedder import Embedder

STOPWORDS = frozenset(
    """a about above after again against all also am an and any are aren't as at be because been before being below
    between both but by can can't cannot could couldn't did didn't do does doesn't doing don't down during each few for
    from further had hadn't has hasn't have haven't having he he'd he'll he's her here here's hers herself him himself
    his how how's i i'd i'll i'm i've if in into is isn't it it's its itself let's me more most mustn't my myself no
    nor not of off on once only or other ought our ours ourselves out over own same shan't she she'd she'll she's
    should shouldn't so some such than that that's the their theirs them themselves then there there's these they
    they'd they'll they're they've this those through to too under until up very was wasn't we we'd we'll we're we've
    were weren't what what's when when's where where's which while who who's whom why why's with won't would wouldn't
    you you'd you'll you're you've your yours yourself yourselves one two three also may might must shall will just
    like get got use used using via per etc e.g i.e yes ok many much new first last well even still however thus
    therefore q a re subject writes wrote article et al ie eg vs now today yesterday tomorrow tonight ago soon later
    recently currently""".split()
) | frozenset(  # conjunctions, prepositions and pronouns outside lemminflect's lexicon, which would pass as nouns
    """although though whereas unless whether among amongst upon toward towards despite behind beside besides onto
    till unto every another either neither none something anything everything nothing someone anyone everyone
    somebody anybody everybody nobody th nd rd""".split()  # "th": what is left of "$n$th" once the formula is cut
) | frozenset(  # number words: "four years", "zero" are quantities, not topics
    """zero four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen
    nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred hundreds thousand thousands million millions
    billion billions trillion second third fourth fifth sixth seventh eighth ninth tenth half twice dozen""".split()
) | frozenset(  # weekdays date a news story ("fcc tuesday", "percent monday"): they are not what it is about
    "monday tuesday wednesday thursday friday saturday sunday".split()
) | frozenset(  # a company's legal form: "barrick gold corp" is about gold, not one more name ending in "corp"
    "inc corp ltd plc llc gmbh".split()
)
# A month alone is a date, not a topic ("october"); in a name it stays ("november uprising").
MONTHS = frozenset("january february march april june july august september october november december".split())
CODE_STOPWORDS = frozenset(
    """def return self cls none true false import from class if else elif for while in is not and or pass break
    continue try except finally raise with as lambda yield assert del global nonlocal print len range int str float
    list dict set tuple bool object args kwargs init main name doc test tests param params type value values result res
    tmp temp var val arr num idx i j k n m x y z a b c d e f g h p q r s t u v w l o function var let const new public
    private static void null this return true false string int32 int64 elif np os sys re typing optional any
    doctest testmod""".split()
) | frozenset(  # Python's plumbing builtins: "isinstance" was a tag of 1-2% of code chunks
    """isinstance issubclass enumerate zip iter repr getattr setattr hasattr delattr callable super staticmethod
    classmethod""".split()
)
IDENTIFIER_STOPWORDS = STOPWORDS | CODE_STOPWORDS  # the words of code identifiers that end a phrase
# Python's own exception classes ("ValueError", "IndexError"): a chunk that raises one is not about errors. As topic
# words they were tags of 5% of the dev corpus' code chunks, of every folder alike ("error", "valueerror").
BUILTIN_EXCEPTIONS = frozenset(name for name, value in vars(builtins).items()
                               if isinstance(value, type) and issubclass(value, BaseException))
# The modules a chunk of code imports: "import numpy as np", "from bs4 import BeautifulSoup", "import os, sys".
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import\b|import[ \t]+([A-Za-z_][\w.]*(?:[ \t]*,[ \t]*"
                    r"[A-Za-z_][\w.]*)*))", re.MULTILINE)
NOT_A_LIBRARY = frozenset({"__future__"})  # a switch of the language, not a library
# "from __future__ import annotations" switches the language too: its words are no topic (28 "annotation" tags)
FUTURE_IMPORT = re.compile(r"^[ \t]*from[ \t]+__future__[ \t]+import[^\n]*", re.MULTILINE)
# Context cues of a verb (see verb_in_context): what comes before a verb, and what follows one.
VERB_BEFORE = frozenset("""i you we they he she it who will would can could should may might must shall won't wouldn't
    can't cannot couldn't shouldn't don't doesn't didn't do does did to not""".split())
VERB_AFTER = frozenset("the a an they he she we i you it me them him us this these those their his its our my your "
                       "up out off away".split())  # an object, or a verb's particle ("wraps up", "strikes me")
# A word (of any alphabet: "Galissonnière" is one word, not "galissonni"), or a token with a digit ("19th", "3x",
# "2004"): a number is no topic word and ends a phrase, so "late 19th century" gives "century", not "late th
# century". "+" and "#" only end a word ("c++", "c#"): "a+b" is a formula.
WORD = re.compile(r"[^\W_]*\d[^\W_]*|[^\W\d_](?:(?:[^\W\d_]|')*[^\W\d_])?(?:\+\+|#)?")
IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
CAMEL = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# A phrase never spans punctuation, a dash between spaces or a blank line (one newline is often a wrapped line).
CLAUSE_BREAK = re.compile(r"""[.,;:!?()\[\]{}<>"“”‘’«»…=*&|\\/]|\s[-–—]+\s|\n\s*\n""")
MAX_CANDIDATES = 20  # phrases embedded per chunk, after a cheap frequency/length pre-ranking
MMR_DIVERSITY = 0.4  # 0: only relevance, 1: only novelty
# A fixed-list field is answered only with entries that clearly stand out from the rest of the list for this
# chunk: cosine >= CANDIDATE_MIN_SIMILARITY and that many standard deviations above the list's mean; else empty.
CANDIDATE_MIN_SIMILARITY = 0.25
CANDIDATE_MIN_Z = 2.5


# Not words of the text's topic: URLs, e-mail addresses and message ids, LaTeX commands ("\\frac", "\\cdot").
NOT_PROSE = re.compile(r"https?://\S+|www\.\S+|\S+@\S+|<[^<>\s]+>|\\[A-Za-z]+")
# A news wire's credit, which says who filed a story, not what it is about: the dateline's "NEW YORK (Reuters) - ",
# and a headline's "(AFP)" when the story's lead repeats it ("...Australian PM (AFP)\n\nAFP - Australian Prime...").
# On the dev corpus 18 AG News stories of all four sections led with AFP, and "afp" was a concept at every seed.
NEWS_CREDIT = re.compile(r"\((?P<credit>[^()\n]{1,40})\)[ \t]*\n\s*(?P=credit)[ \t]+[-–—]{1,2}\s"
                         r"|\([^()\n]{1,40}\)(?=[ \t]+[-–—]{1,2}\s)")
# Mathematics, which names points and variables ("$ABC$", "$a+b$"), not topics: display and inline TeX, and Asymptote
# figures. An inline "$" pair follows pandoc's rule (no space inside either "$", no digit after the closing one), so
# the prices in "$5 million for the stadium and $10 more" stay prose.
MATH = re.compile(r"\$\$[\s\S]*?\$\$|\\\[[\s\S]*?\\\]|\\\([\s\S]*?\\\)|\[asy\][\s\S]*?\[/asy\]"
                  r"|\\begin\{([a-z]+\*?)\}[\s\S]*?\\end\{\1\}|\$(?=[^\s$])(?:\\.|[^$\\])*?(?<=[^\s$\\])\$(?!\d)")
# What a formula's notation names. An LLM reads "$\binom{8}{3}$" as a binomial coefficient; the offline tagger cuts
# formulas out of the prose (MATH) and takes these objects from their LaTeX commands and environments instead. Only
# commands with one mathematical reading are mapped: not "\overline" (a segment, a repeating decimal, a conjugate) or
# "\circ" (degrees, composition), nor "\cdot" and "\times", which every subject writes.
FORMULA_OBJECTS = {
    **dict.fromkeys(("frac", "dfrac", "tfrac"), "fraction"),
    "sqrt": "square root",
    **dict.fromkeys(("sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan"),
                    "trigonometric function"),
    **dict.fromkeys(("log", "ln"), "logarithm"),
    **dict.fromkeys(("binom", "dbinom", "tbinom", "choose"), "binomial coefficient"),
    **dict.fromkeys(("pmod", "bmod", "mod", "equiv"), "congruence"),
    "gcd": "greatest common divisor",
    **dict.fromkeys(("lfloor", "rfloor", "lceil", "rceil"), "floor function"),
    **dict.fromkeys(("angle", "measuredangle"), "angle"),
    "triangle": "triangle",
    "perp": "perpendicular line",
    "parallel": "parallel line",
    **dict.fromkeys(("vec", "overrightarrow", "mathbf"), "vector"),
    **dict.fromkeys(("pmatrix", "bmatrix", "vmatrix", "matrix", "det"), "matrix"),
    "sum": "summation",
    "int": "integral",
    "lim": "limit",
    "infty": "infinity",
    **dict.fromkeys(("le", "leq", "ge", "geq", "lt", "gt"), "inequality"),
    **dict.fromkeys(("cup", "cap", "subset", "subseteq", "emptyset", "varnothing"), "set"),
    "pi": "pi",
}
LATEX_COMMAND = re.compile(r"\\(?:begin\{([a-z]+)\*?\}|([A-Za-z]+))")
FACTORIAL = re.compile(r"(?<=[\w)}])!")
TRIPLE_QUOTED = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'')
COMMENT_OR_DOCSTRING = re.compile(rf"#[^\n]*|{TRIPLE_QUOTED.pattern}|//[^\n]*|/\*[\s\S]*?\*/")
DEFINITION = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+\w", re.MULTILINE)  # code, never a docstring
# Code inside the prose of code: a docstring's doctest lines (">>> from string import ascii_letters") and doctest
# directives ("# doctest: +ELLIPSIS").
DOCTEST = re.compile(r"^[ \t]*(?:>>>|\.\.\.)[^\n]*|#[ \t]*doctest:[^\n]*", re.MULTILINE)
# A docstring's markup: section headings (Google "Returns:", NumPy "Examples" over a dashed line), fields (reST
# ":param x:", JSDoc "@returns") and the "Return"/"Returns" that opens a line ("Return True if ..."). They say how a
# docstring is laid out, not what the code does. Only the markup goes: "return statement" and "keyword argument" in
# the prose of the Python docs are topics.
DOCSTRING_MARKUP = re.compile(
    r"^[ \t]*(?:args|arguments|keyword args|kwargs|parameters|params|other parameters|returns?|yields?|raises?|"
    r"examples?|notes?|attributes|references|see also|warnings?|usage|todo)[ \t]*:?[ \t]*$|^[ \t]*-{3,}[ \t]*$"
    r"|:(?:param|type|returns?|rtype|raises?|var|ivar|cvar)\b[^:\n]*:|@(?:param|returns?|raises?|throws)\b"
    r"|^[ \t]*(?P<quotes>[rRuUbB]?(?:\"\"\"|\'\'\'))?[ \t]*(?-i:Returns?|Yields?)\b",
    re.MULTILINE | re.IGNORECASE)
# A doctest example whole: its ">>>" line and the output expected of it, which runs to the next blank line, ">>>"
# line or end of the docstring. The output is what the code prints, not prose: "Traceback (most recent call last):
# ... ValueError" made "traceback" a tag of 4% of the dev corpus' code chunks.
DOCTEST_EXAMPLE = re.compile(r"^[ \t]*>>>[^\n]*(?:\n(?![ \t]*\n)(?![ \t]*>>>)(?![^\n]*(?:\"\"\"|\'\'\'))[^\n]*)*"
                             r"|#[ \t]*doctest:[^\n]*", re.MULTILINE)


@lru_cache(maxsize=200_000)
def lemmas(word: str) -> dict[str, tuple[str, ...]]:
    """The word's lemmas by part of speech in lemminflect's English lexicon ({} for a word it does not know)."""
    import lemminflect

    return lemminflect.getAllLemmas(word)


@lru_cache(maxsize=200_000)
def word_class(word: str) -> str:
    """"noun", "adj" or "break", from the English lexicon of lemminflect (no model, no download).

    A topical phrase is a noun phrase: words that can only be verbs, adverbs or auxiliaries ("gives",
    "causing", "instead") end it, as stopwords do. Words outside the lexicon are names, jargon or
    identifiers ("tesla", "stderr"): nouns.
    """
    if word in STOPWORDS or len(word) < 2 or not word[0].isalpha():
        return "break"
    pos = lemmas(word)
    if not pos or "NOUN" in pos or "PROPN" in pos:
        return "noun"
    return "adj" if "ADJ" in pos else "break"


def in_lexicon(word: str) -> bool:
    """Whether lemminflect's English lexicon knows the word (names, jargon, typos and code fragments: no)."""
    return bool(lemmas(word))


@lru_cache(maxsize=200_000)
def singular(word: str) -> str:
    """The noun's singular ("integers" -> "integer", "matrices" -> "matrix"); "data", "news", "physics" stay."""
    if not word.endswith("s"):
        return word
    nouns = lemmas(word).get("NOUN")
    return nouns[0] if nouns else word


def singular_name(name: str) -> str:
    """The name with its last word in the singular: from the English lexicon, else by its plural "s" ("huguenots",
    a word the lexicon does not know), so that a name and its plural compare as one."""
    *head, last = name.split() or [""]
    one = singular(last)
    if not in_lexicon(last) and len(last) > 3 and last.endswith("s") and not last.endswith(("ss", "us", "is")):
        one = last[:-1]
    return " ".join([*head, one])


def imported_modules(text: str) -> list[str]:
    """The top-level modules a chunk of code imports, in order of first import ("numpy", "bs4"), lowercase."""
    modules = []
    for source, names in IMPORT.findall(DOCTEST.sub(" ", text)):
        for name in [source] if source else names.split(","):
            top = name.strip().split(".")[0].lower()
            if top and top not in NOT_A_LIBRARY and top not in modules:
                modules.append(top)
    return modules


def formula_objects(text: str) -> Counter:
    """The mathematical objects a text's LaTeX names (FORMULA_OBJECTS, and "factorial" for "$5!$"), with counts."""
    found = Counter(FORMULA_OBJECTS.get(env or command) for env, command in LATEX_COMMAND.findall(text))
    found["factorial"] = sum(len(FACTORIAL.findall(m.group())) for m in MATH.finditer(text))
    del found[None]
    return +found


def _phrases_of_runs(runs: list[list[str]], counts: Counter, first: dict) -> None:
    """1-3 word noun phrases inside each run: no phrase ends on an adjective or repeats a word, and its
    head (last word) is put in the singular, so "prime numbers" and "prime number" are one tag."""
    for position, run in enumerate(runs):
        for n in (1, 2, 3):
            for i in range(len(run) - n + 1):
                words = run[i : i + n]
                if word_class(words[-1]) != "noun" or len(set(words)) < n or (
                        n == 1 and (len(words[0]) < 3 or words[0] in MONTHS)):
                    continue
                if any(singular(w) != w for w in words[:-1]):  # "numbers reach": a plural ends its noun phrase
                    continue
                phrase = " ".join(words[:-1] + [singular(words[-1])])
                counts[phrase] += 1
                first.setdefault(phrase, position)


def adverb_only(word: str) -> bool:
    """"likely", "quickly": words that modify a verb and are no noun (looked past to find a verb's subject)."""
    pos = lemmas(word)
    return "ADV" in pos and "NOUN" not in pos


def verb_in_context(words: list[str], i: int) -> bool:
    """Whether ``words[i]``, a word that may be a noun or a verb ("say", "think", "end"), is a verb here: after a
    subject pronoun, an auxiliary or "to" ("they say", "you think", "won't give", "will likely end", "to help"), or
    before an object pronoun or an article ("say they", "give the"). The lexicon alone keeps "nigeria say" and
    "think oil" as phrases; without a tagger, these cues catch the common cases, at the price of a noun after "to"
    ("the road to power" loses "power" there)."""
    if "VERB" not in lemmas(words[i]):
        return False
    j = i - 1
    while j >= 0 and words[j] not in VERB_BEFORE and adverb_only(words[j]):  # "to" has an adverb reading too
        j -= 1
    return (j >= 0 and words[j] in VERB_BEFORE) or (i + 1 < len(words) and words[i + 1] in VERB_AFTER)


class PlainDataUnpickler(pickle.Unpickler):
    """Reads a pickle of plain data only (dicts, lists, strings, numbers, sets): any other class or function it names
    is refused before it can run, so a tampered weights file cannot execute code (no pickle is loaded unrestricted)."""

    ALLOWED = {("__builtin__", "set"), ("builtins", "set"), ("__builtin__", "frozenset"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}, which is not plain data")
        return super().find_class(module, name)


@lru_cache(maxsize=1)
def _pos_tagger():
    """NLTK's averaged perceptron tagger with the weights the ``textblob-aptagger`` package ships (Penn Treebank tags,
    trained on the Wall Street Journal; about 97% of words right there). NLTK's own weights are a separate download;
    these come with the package, so nothing is fetched. The package's module is not imported (it needs a TextBlob
    of 2014): only its weights file is read."""
    import importlib.util
    from pathlib import Path

    from nltk.tag.perceptron import PerceptronTagger

    spec = importlib.util.find_spec("textblob_aptagger")
    if spec is None:
        raise ImportError("the offline tagger needs textblob-aptagger: pip install 'atlas-concepts[embed]'")
    with open(Path(spec.submodule_search_locations[0]) / "trontagger-0.1.0.pickle", "rb") as f:
        weights, tagdict, classes = PlainDataUnpickler(f, encoding="latin1").load()  # pickled by Python 2
    tagger = PerceptronTagger(load=False)
    tagger.model.weights, tagger.tagdict, tagger.classes, tagger.model.classes = weights, tagdict, classes, classes
    return tagger


def part_of_speech(tokens: list[str]) -> list[str]:
    """The Penn Treebank tag of each token of a text ("NN", "VBD", ...), in its context. The tokens keep their case:
    a capital is how the tagger knows "Kelly" and "Luther" for names (lowercase, they came out as an adverb)."""
    return [tag for _, tag in _pos_tagger().tag(tokens)] if tokens else []


def in_noun_phrase(words: list[str], tags: list[str], i: int, run_open: bool) -> bool:
    """Whether the tagger lets word ``i`` be part of a noun phrase: a noun, an adjective, a foreign word or an "-ing"
    form (which the lexicon then judges: "learning" and "building" are nouns, "causing" is not); a past participle
    only where it opens a phrase before a noun ("given name"), not after one, where it is a verb. Verbs, adverbs,
    modals and function words end a phrase: "capital samarkand fell", "algorithm takes" and "luther married" are no
    phrases, though "fell", "take" and "married" can be nouns or adjectives. A verb tag on a word that is no such form
    of a verb in the lexicon is the tagger's slip ("the circle has radius 3": "radius" as a past participle), and is
    overruled; so is an adverb tag on a word the lexicon knows as no adverb. A word outside the lexicon stays a noun,
    as word_class has it: on names the tagger's weights slip ("Aeschylus" as a conjunction, "Ovid" as a symbol)."""
    tag = tags[i]
    if tag.startswith(("NN", "JJ", "FW")) or tag == "VBG" or not in_lexicon(words[i]):
        return True
    if tag == "VBN" and not run_open and i + 1 < len(tags) and tags[i + 1].startswith(("NN", "JJ")):
        return True
    return tag.startswith(("VB", "RB")) and not lexicon_allows(words[i], tag)


@lru_cache(maxsize=200_000)
def lexicon_allows(word: str, tag: str) -> bool:
    """Whether the English lexicon has ``word`` as the verb form (VB*: "fell" is a VBD of "fall") or the adverb (RB*)
    the tagger says it is."""
    import lemminflect

    if tag.startswith("RB"):
        return "ADV" in lemmas(word)
    return any(word in lemminflect.getInflection(lemma, tag) for lemma in lemmas(word).get("VERB", ()))


def _runs(words: list[str], stop: frozenset, tags: list[str] | None = None) -> list[list[str]]:
    """Maximal runs of consecutive words that can be part of a noun phrase. ``tags``: the words' parts of speech in
    their clause (prose); without them (the words of an identifier) verb_in_context's cues stand in."""
    runs, run = [], []
    for i, word in enumerate(words):
        in_phrase = in_noun_phrase(words, tags, i, bool(run)) if tags is not None else not verb_in_context(words, i)
        if word not in stop and word_class(word) != "break" and in_phrase:
            run.append(word)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def _tagged_clauses(prose: str) -> list[tuple[list[str], list[str]]]:
    """The word tokens of each clause of ``prose`` with their parts of speech, tagged in one pass so each word has its
    sentence around it (a clause alone, such as "(nerve damage)", reads as an order: "nerve" a verb). A comma stands
    in for each clause break."""
    clauses = [WORD.findall(clause) for clause in CLAUSE_BREAK.split(prose)]
    flat = [token for tokens in clauses for token in [*tokens, ","]]
    tags, out, start = part_of_speech(flat), [], 0
    for tokens in clauses:
        out.append((tokens, tags[start : start + len(tokens)]))
        start += len(tokens) + 1
    return out


def _words(tokens: list[str]) -> list[str]:
    return [w.lower().removesuffix("'s") for w in tokens]


def _identifier_runs(code: str) -> list[list[str]]:
    """The words of each identifier of the code (``binary_search``, ``binarySearch`` -> binary, search), as runs."""
    identifiers = [[part.lower() for part in CAMEL.findall(name.replace("_", " ")) if part.isalpha()]
                   for name in IDENTIFIER.findall(code) if name not in BUILTIN_EXCEPTIONS]
    return [run for parts in identifiers for run in _runs(parts, IDENTIFIER_STOPWORDS)]


def _keep_quotes(markup: re.Match) -> str:
    """DOCSTRING_MARKUP's replacement: a clause break, after the quotes that open a docstring if it took them."""
    return (markup.group("quotes") or "") + " . "


def code_prose(source: str) -> list[str]:
    """The comments and docstrings of a chunk of code. A chunk cut inside a docstring opens with the docstring's tail,
    which its first triple quote closes; pairing quotes from the chunk's start takes the code between two docstrings
    for one (101 of the dev corpus' 2,240 code chunks open in a docstring; "def solution" was one of 47 "def ..." tags
    they gave). So when the first pair holds a definition line, the text before the first quote is a docstring's tail
    and pairing starts after that quote."""
    first = TRIPLE_QUOTED.search(source)
    if first is None or not DEFINITION.search(first.group()):
        return COMMENT_OR_DOCSTRING.findall(source)
    return [source[: first.start()], *COMMENT_OR_DOCSTRING.findall(source, first.start() + 3)]


def candidate_phrases(text: str, code: bool = False, limit: int = MAX_CANDIDATES) -> list[str]:
    """Noun phrases of 1-3 words within a clause, pre-ranked by count, length and first position.

    For code, phrases come from comments and docstrings (as prose, without their doctest examples and the output
    expected of them, nor their section headings) and from identifiers split into words (``binary_search``,
    ``binarySearch`` -> "binary search"; not Python's exception classes), never across two identifiers; a chunk of
    doctests only gets the identifiers of its doctest lines.
    """
    counts: Counter[str] = Counter()
    first: dict[str, int] = {}
    source = text
    if code:  # markup, doctest examples and __future__ switches are no prose, and their identifiers no topic
        source = DOCSTRING_MARKUP.sub(_keep_quotes, DOCTEST_EXAMPLE.sub(" . ", FUTURE_IMPORT.sub(" ", text)))
    parts = code_prose(source) if code else [text]
    prose = [NOT_PROSE.sub(" ", MATH.sub(" . ", NEWS_CREDIT.sub(" . ", part))) for part in parts]
    runs = [run for part in prose for tokens, tags in _tagged_clauses(part)
            for run in _runs(_words(tokens), STOPWORDS, tags)]
    if code:
        runs += _identifier_runs(source)
        if not runs:  # doctests only: the functions they call are what the chunk is about
            runs = _identifier_runs("\n".join(DOCTEST.findall(text)))
    _phrases_of_runs(runs, counts, first)
    if not code:
        for phrase, n in formula_objects(text).items():
            counts[phrase] += n
            first.setdefault(phrase, len(runs))  # after the prose's phrases when counts tie
    ranked = sorted(counts, key=lambda p: (-counts[p] * (1 + 0.5 * p.count(" ")), first[p], p))
    return ranked[:limit]


def mmr(doc: np.ndarray, candidates: np.ndarray, k: int, diversity: float = MMR_DIVERSITY) -> list[int]:
    """Indices of k candidates by maximal marginal relevance (vectors are L2-normalized)."""
    if len(candidates) == 0 or k <= 0:
        return []
    relevance = candidates @ doc
    similarity = candidates @ candidates.T
    chosen = [int(np.argmax(relevance))]
    while len(chosen) < min(k, len(candidates)):
        redundancy = similarity[:, chosen].max(axis=1)
        score = (1 - diversity) * relevance - diversity * redundancy
        score[chosen] = -np.inf
        chosen.append(int(np.argmax(score)))
    return chosen


def clear_candidates(values: list[str], scores: np.ndarray, k: int) -> list[str]:
    """Up to k list entries that clearly stand out for this chunk (see CANDIDATE_MIN_Z); often none."""
    spread = scores.std() or 1.0
    z = (scores - scores.mean()) / spread
    order = np.argsort(-scores, kind="stable")[:k]
    return [values[i] for i in order if scores[i] >= CANDIDATE_MIN_SIMILARITY and z[i] >= CANDIDATE_MIN_Z]


def proxy_score(cosine: float) -> int:
    """Cosine similarity -> the judge's 1-5 scale (bins checked by eye on MiniLM; a proxy, not a judge)."""
    return 1 + int(np.searchsorted([0.15, 0.25, 0.35, 0.5], cosine, side="right"))


class OfflineEngine(LLMEngine):
    name = "offline"

    def __init__(self, config: LLMConfig, embedding_model: str = "all-MiniLM-L6-v2"):
        super().__init__(config)
        self.embedder = Embedder(embedding_model)

    def identity(self) -> dict:
        return {"engine": self.name, "embedding_model": self.embedder.model_name, "mmr_diversity": MMR_DIVERSITY,
                "max_candidates": MAX_CANDIDATES,
                "candidate_min": [CANDIDATE_MIN_SIMILARITY, CANDIDATE_MIN_Z], "version": 18}

    def setup(self) -> None:
        self.embedder.setup()
        _pos_tagger()  # its weights load once per process (about 2 s)

    def generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        tags = [r for r in requests if r.context.get("task") == "tag"]
        judge = [r for r in requests if r.context.get("task") == "judge"]
        answers = self._tag(tags) | self._judge(judge)
        return [
            LLMResult(r.key, text=json.dumps(answers[r.key]), finish_reason="stop") if r.key in answers
            else LLMResult(r.key, error=f"offline engine: unknown task {r.context.get('task')!r}")
            for r in requests
        ]

    def _embed_all(self, texts: list[str]) -> dict[str, np.ndarray]:
        unique = sorted(set(texts))  # a fixed order: the same batch gives the same vectors
        return dict(zip(unique, self.embedder.encode(unique)))

    def _tag(self, requests: list[LLMRequest]) -> dict[str, dict]:
        if not requests:
            return {}
        plans = []
        for r in requests:
            code = r.context["domain"] == "code"
            plans.append((r, candidate_phrases(r.context["text"], code=code)))
        lists = {name: values for r in requests for name, values in r.context["candidates"].items()}
        phrases = [p for _, cands in plans for p in cands] + [v for values in lists.values() for v in values]
        vectors = self._embed_all(phrases)
        docs = self.embedder.encode([r.context["text"] for r in requests])
        return {request.key: self._answer(request, cands, vectors, doc) for (request, cands), doc in zip(plans, docs)}

    @staticmethod
    def _answer(request: LLMRequest, cands: list[str], vectors: dict[str, np.ndarray], doc: np.ndarray) -> dict:
        """One chunk's answer. With no candidate phrase at all (e.g. only numbers and symbols) the
        keyphrase fields stay empty, the answer fails validation and the chunk is quarantined."""
        properties = request.schema["properties"]
        keyphrase_fields = [(f, p["x-atlas-offline"]["k"]) for f, p in properties.items()
                            if p["x-atlas-offline"]["method"] == "keyphrases"]
        matrix = np.array([vectors[c] for c in cands], dtype=np.float32).reshape(len(cands), doc.shape[0])
        order = mmr(doc, matrix, sum(k for _, k in keyphrase_fields))
        answer, taken = {}, 0
        for position, (field, k) in enumerate(keyphrase_fields):
            later = len(keyphrase_fields) - position - 1  # keep one phrase for each later field if we can
            n = max(1, min(k, len(order) - taken - later))
            answer[field] = [cands[i] for i in order[taken : taken + n]]
            taken += n
        for field, spec in properties.items():
            offline = spec["x-atlas-offline"]
            if offline["method"] == "imports":
                answer[field] = imported_modules(request.context["text"])[: offline["k"]]
            elif offline["method"] == "candidates":
                values = request.context["candidates"][offline["list"]]
                answer[field] = clear_candidates(values, np.array([vectors[v] for v in values]) @ doc, offline["k"])
        return {field: answer[field] for field in properties}

    def _judge(self, requests: list[LLMRequest]) -> dict[str, dict]:
        if not requests:
            return {}
        vectors = self._embed_all([c for r in requests for c in r.context["concepts"]])
        docs = self.embedder.encode([r.context["text"] for r in requests])
        return {
            r.key: {chr(ord("A") + i): proxy_score(float(vectors[c] @ doc))
                    for i, c in enumerate(r.context["concepts"])}
            for r, doc in zip(requests, docs)
        }
