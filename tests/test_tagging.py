"""Schemas, prompts, answer parsing with repairs, normalization, the offline keyphrase algorithm."""

import json

import numpy as np
import pytest

from atlas.config import TagConfig
from atlas.llm.answers import SchemaError, file_answers, load_schemas, normalize_tag, parse_answer
from atlas.llm.offline import (
    candidate_phrases,
    clear_candidates,
    formula_objects,
    imported_modules,
    in_lexicon,
    mmr,
    proxy_score,
)
from atlas.llm.prompts import PromptError, load_prompt
from atlas.stages.tag import PROMPT_PLACEHOLDERS, _prompt_path


@pytest.fixture(scope="module")
def schemas():
    return load_schemas(TagConfig())[0]


@pytest.mark.parametrize("raw, norm", [
    ("Astronomical-Objects", "astronomical objects"),
    ("  how-to_guide ", "how to guide"),
    ('"Shiny Pokémon."', "shiny pokémon"),
    ("C++", "c++"),
    ("Vieta's formulas", "vieta's formulas"),
    ("---", ""),
])
def test_normalize_tag(raw, norm):
    assert normalize_tag(raw) == norm


def test_every_shipped_schema_and_the_prompt_are_valid(schemas):
    assert {"web", "academic", "math", "code", "qa", "generic"} <= set(schemas)
    for schema in schemas.values():
        assert 4 <= len(schema.fields) <= 6  # paper 4.2.1: 4-6 fields per domain
    assert schemas["code"].fields == ["language", "design_pattern", "algorithm", "libraries", "role", "documentation"]
    from atlas.config import load_config

    load_prompt(_prompt_path(load_config(None)), PROMPT_PLACEHOLDERS)


def test_broken_prompt_and_schema_files_are_named(tmp_path):
    bad = tmp_path / "tag.yaml"
    bad.write_text("version: 1\nsystem: hi\nuser: 'no text here {domain}'\nrepair: '{problem} {field_names}'\n")
    with pytest.raises(PromptError, match=r"tag.yaml: template 'user' lacks placeholder\(s\) "
                                          r"\['domain_description', 'fields', 'text'\]"):
        load_prompt(bad, PROMPT_PLACEHOLDERS)
    bad.write_text("version: 1\nsystem: hi {oops}\nuser: x\nrepair: y\n")
    with pytest.raises(PromptError, match="unknown placeholder"):
        load_prompt(bad, PROMPT_PLACEHOLDERS)
    (tmp_path / "tags").mkdir()
    (tmp_path / "candidates").mkdir()
    schema = {"type": "object", "properties": {"main": {"type": "array", "items": {"type": "string"},
                                                        "x-atlas-offline": {"method": "candidates", "list": "nope"}}}}
    (tmp_path / "tags" / "generic.json").write_text(json.dumps(schema))
    with pytest.raises(SchemaError, match="generic.json: field 'main' names candidate list 'nope'"):
        load_schemas(TagConfig(schema_dir=str(tmp_path)))
    schema["properties"]["main"]["x-atlas-offline"] = {"method": "keyphrases", "k": 2}
    schema["properties"]["main"]["x-atlas-extensions"] = ["py"]
    (tmp_path / "tags" / "generic.json").write_text(json.dumps(schema))
    with pytest.raises(SchemaError, match="generic.json: field 'main' has \"x-atlas-extensions\" that is not an"):
        load_schemas(TagConfig(schema_dir=str(tmp_path)))
    (tmp_path / "tags" / "generic.json").write_text("{not json")
    with pytest.raises(SchemaError, match="generic.json: not valid JSON"):
        load_schemas(TagConfig(schema_dir=str(tmp_path)))


def test_a_code_files_extension_answers_its_language(schemas):
    assert file_answers(schemas["code"], "code:maths/perfect_number.py") == {"language": ["python"]}
    assert file_answers(schemas["code"], "repo/src/Main.CPP") == {"language": ["c++"]}
    # no extension, one the map lacks (".m": MATLAB or Objective-C), a dot inside a folder's name: the engine answers
    for doc_id in ("python-stdlib:bisect", "lib/solver.m", "20ng:train-rec.motorcycles/104943", "notes.py/README"):
        assert file_answers(schemas["code"], doc_id) == {}, doc_id
    assert file_answers(schemas["generic"], "docs/setup.py") == {}  # only fields that map extensions


def _good(schema):
    return {field: [f"{field} tag"] for field in schema.fields}


def test_parse_valid_and_repaired_answers(schemas):
    web = schemas["web"]
    ok = parse_answer(json.dumps(_good(web)), "stop", web)
    assert ok.answer == _good(web) and not ok.repairs
    chatty = parse_answer("Sure! ```json\n" + json.dumps(_good(web)) + "\n```", "stop", web)
    assert chatty.answer == _good(web) and chatty.repairs == ["extracted_json"]
    extra = parse_answer(json.dumps(_good(web) | {"mood": ["x"]}), "stop", web)
    assert extra.answer == _good(web) and extra.repairs == ["dropped_extra_fields"]
    stringy = parse_answer(json.dumps(_good(web) | {"main": "space, rockets; orbits"}), "stop", web)
    assert stringy.answer["main"] == ["space", " rockets", " orbits"] and "string_to_list" in stringy.repairs
    many = parse_answer(json.dumps(_good(web) | {"tone": ["a", "b", "c", "d", "e"]}), "stop", web)
    assert many.answer["tone"] == ["a", "b", "c"] and "too_many_items" in many.repairs


@pytest.mark.parametrize("text, finish, reason", [
    (None, None, "no_answer"),
    ('{"main": ["a"], "purpose": ["b"', "length", "truncated"),
    ("I cannot help with that.", "stop", "invalid_json"),
    ("[1, 2]", "stop", "invalid_json"),
    ('{"main": ["a"], "purpose": ["b"]}', "stop", "missing_field"),
    ('{"main": [], "purpose": ["b"], "tone": ["c"], "minor": ["d"]}', "stop", "schema_violation"),
    ('{"main": ["' + "x" * 200 + '"], "purpose": ["b"], "tone": ["c"], "minor": ["d"]}', "stop", "schema_violation"),
])
def test_unusable_answers_get_a_reason(schemas, text, finish, reason):
    parsed = parse_answer(text, finish, schemas["web"])
    assert parsed.answer is None and parsed.problem == reason and parsed.detail


def test_candidate_phrases_and_mmr():
    phrases = candidate_phrases("The Apollo program landed astronauts on the Moon. The Apollo program ended in 1972.")
    assert phrases[0] == "apollo program" and "the" not in phrases
    code = candidate_phrases('def binary_search(sortedList, target):\n    """Bisection search."""\n    return -1',
                             code=True)
    assert {"binary search", "bisection search", "target"} <= set(code) and "def" not in code
    doctest = candidate_phrases('def caesar(text):\n    """Shift each letter.\n\n'
                                '    >>> from string import ascii_letters\n'
                                '    >>> caesar("abc")  # doctest: +NORMALIZE_WHITESPACE\n    """', code=True)
    assert {"letter", "caesar"} <= set(doctest) and not {"string import ascii", "ascii letter", "whitespace"} & set(
        doctest)  # a docstring's doctest lines are code, not prose
    raises = candidate_phrases(
        'from __future__ import annotations\n\n\ndef is_perfect(n):\n'
        '    """Return True if n is a perfect number.\n\n    Returns:\n        bool\n\n    Examples:\n'
        '    >>> is_perfect(-1)\n    Traceback (most recent call last):\n        ...\n'
        '    ValueError: undefined for negative numbers\n    >>> is_perfect(6)\n    True\n    """\n'
        '    if not isinstance(n, int) or n < 0:\n        raise ValueError("negative")\n'
        '    return sum(d for d in range(1, n) if n % d == 0) == n', code=True)
    assert "perfect number" in raises and not {"traceback", "call", "error", "value error", "negative number",
                                               "example", "return", "isinstance", "annotation", "future"} & set(
        raises)  # no markup, no doctest output, no plumbing
    cut = candidate_phrases('the maximum string for a magic ring.\n"""\n\nfrom itertools import permutations\n\n\n'
                            'def solution(side: int = 5) -> int:\n    """Find the largest ring."""\n    return 1\n',
                            code=True)  # a chunk cut inside a docstring: its first quotes close one
    assert {"magic ring", "largest ring", "solution"} <= set(cut) and not {p for p in cut if p.startswith("def ")}
    only_doctests = candidate_phrases("    >>> rec_ternary_search(0, len(test_list), test_list, 3)\n    -1\n",
                                      code=True)
    assert "ternary search" in only_doctests  # ... unless there is nothing else: the function they call
    # noun phrases within a clause: verbs, adverbs, numbers and punctuation end a phrase; heads are singular
    prose = candidate_phrases("Susan gives Robert four cats. The prime numbers reach zero, causing errors instead. "
                              "Mail kolstad@cae.wisc.edu or see http://example.com/x about \\frac{1}{2} fractions.")
    assert {"prime number", "susan", "robert", "cat", "fraction"} <= set(phrases + prose)
    assert not {p for p in prose if {"gives", "causing", "instead", "four", "edu", "frac", "http"} & set(p.split())}
    assert "cats susan" not in prose and "number reach" not in prose
    # a word that may be a noun or a verb is a verb after a subject or an auxiliary, or before an object
    news = candidate_phrases("Oil companies in Nigeria say they won't give in. If you think oil is expensive now, "
                             "the strike will likely end. The end of the strike came.")
    assert {"oil company", "nigeria", "strike", "end"} <= set(news)
    assert not {p for p in news if {"say", "give", "think", "now"} & set(p.split())}
    # ... and wherever the part-of-speech tagger reads it as a verb in its sentence, past tense included; a tag the
    # lexicon rules out ("radius" as a participle) and a tag on a name (outside the lexicon) are overruled
    tagged = candidate_phrases("After the capital Samarkand fell, Luther married Katharina von Bora. The algorithm "
                               "takes linear time, as playwrights Aeschylus and Ovid knew. The circle has radius 3.")
    assert {"capital samarkand", "katharina von bora", "linear time", "aeschylus", "ovid", "radius"} <= set(tagged)
    assert not {p for p in tagged if {"fell", "married", "take", "takes"} & set(p.split())}
    # "to" before a verb is no adverb to look past ("to grab"); weekdays date a story and a month alone is no topic
    dated = candidate_phrases("On Tuesday the cable industry tried to grab VoIP's coattails. In October, the "
                              "November Uprising began.")
    assert {"cable industry", "voip coattails", "november uprising"} <= set(dated)
    assert not {p for p in dated if {"grab", "tuesday"} & set(p.split())} and "october" not in dated
    # mathematics names points and variables, not topics; a price's "$" is no formula; a number ends a phrase
    math = candidate_phrases("In triangle $ABC$, the bisector meets $BC$ at $D$. Find $a+b+c$ if \\[x^2+y^2=1.\\] "
                             "[asy] pair pc = dir(30); label(\"$P$\", pc); [/asy] The circle has radius 3.")
    assert {"triangle", "bisector", "circle", "radius"} <= set(math)
    assert not {p for p in math if {"abc", "bc", "a+b", "pc", "dir", "pair", "label"} & set(p.split())}
    # ... but its notation names objects: a binomial coefficient, a congruence, a matrix, a factorial
    objects = formula_objects("Find $\\dbinom{8}{3} + 5!$ if $x \\equiv 2 \\pmod{7}$, "
                              "$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$ and $\\overline{AB} \\cdot 2$. Wow!")
    assert objects == {"binomial coefficient": 1, "factorial": 1, "congruence": 2, "matrix": 1}
    assert "congruence" in candidate_phrases("Solve the congruence $30x \\equiv 42 \\pmod{47}$.")
    assert "square root" in candidate_phrases("Simplify $\\sqrt{50}$.")  # a formula's object, with no prose phrase
    assert "square root" not in candidate_phrases('x = "\\sqrt{2}"  # a string', code=True)  # code has no formulas
    money = candidate_phrases("Acme raised $5 million for the new stadium and $10 more for C++ and C# courses, "
                              "although the late 19th century stadium was sold.")
    assert {"stadium", "c++", "c# course", "century"} <= set(money)
    assert not {p for p in money if {"th", "although", "late"} & set(p.split())}
    assert imported_modules("from __future__ import annotations\nimport numpy as np\nimport os, sys.path\n"
                            "from bs4 import BeautifulSoup\nfrom .utils import x\n    import requests\n"
                            "text = 'import this' # not an import\n>>> import doctest\n") == [
        "numpy", "os", "sys", "bs4", "requests"]
    # a wire's credit says who filed the story, a company's legal form what kind of entity it is: neither is a topic
    wire = candidate_phrases("Nigerian troops set off on AU peace mission to Darfur (AFP)\n\nAFP - A company of "
                             "Nigerian infantry flew out.\n\nLAGOS (Reuters) - Barrick Gold Corp. and LG Electronics "
                             "Inc. signed a co-op deal.")
    assert {"nigerian troop", "darfur", "lagos", "barrick gold", "lg electronics", "co op deal"} <= set(wire)
    assert not {p for p in wire if {"afp", "reuters", "corp", "inc"} & set(p.split())}
    assert "nasa" in candidate_phrases("The space agency (NASA) launched a probe - a big one.")  # no credit
    assert "galissonnière" in candidate_phrases("The cruiser La Galissonnière sailed.")  # one word, any alphabet
    assert in_lexicon("decorator") and not in_lexicon("cabracadabrarrarrad")
    assert clear_candidates(["sports", "law", "music"], np.array([0.9, 0.1, 0.12]), 2) == []  # 3 entries: no z >= 2.5
    values = [f"v{i}" for i in range(20)]
    scores = np.r_[0.6, np.full(19, 0.1)]
    assert clear_candidates(values, scores, 2) == ["v0"]  # only what clearly stands out, never the rest of k
    assert clear_candidates(values, np.full(20, 0.3), 2) == []
    doc = np.array([1.0, 0.0])
    vectors = np.array([[1.0, 0.0], [0.99, 0.141], [0.6, 0.8]])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert mmr(doc, vectors, 2, diversity=0.0) == [0, 1]
    assert mmr(doc, vectors, 2, diversity=0.7) == [0, 2]  # the near-duplicate loses to the diverse phrase
    assert [proxy_score(c) for c in (0.0, 0.2, 0.3, 0.4, 0.9)] == [1, 2, 3, 4, 5]


def test_request_cache_misses_when_anything_the_engine_sees_changes(tmp_path):
    from atlas.llm.cache import RequestCache
    from atlas.llm.engine import LLMRequest, LLMResult

    request = LLMRequest(key="doc:00001#1", system="s", user="the chunk text", schema={"type": "object"})
    cache = RequestCache(tmp_path / "c.jsonl", {"engine": "openai", "model": "m"})
    cache.put(request, LLMResult(request.key, text='{"a": 1}', finish_reason="stop", tokens_in=5))
    cache.put(request, LLMResult(request.key, error="http_500"))  # errors are not cached over answers
    assert cache.get(request).text == '{"a": 1}'
    changed = LLMRequest(key="doc:00001#1", system="s", user="another chunk text", schema={"type": "object"})
    assert cache.get(changed) is None
    cache.close()
    assert RequestCache(tmp_path / "c.jsonl", {"engine": "openai", "model": "m"}).get(request).tokens_in == 5
    other_model = RequestCache(tmp_path / "c.jsonl", {"engine": "openai", "model": "m2"})
    assert other_model.get(request) is None


@pytest.mark.slow
def test_offline_engine_answers_a_chunk_without_any_word(schemas):
    """No candidate phrase at all: an answer that fails validation (the chunk is quarantined), no crash; a chunk of
    code in the same batch gets the modules it imports."""
    from atlas.config import LLMConfig
    from atlas.llm.engine import LLMRequest
    from atlas.llm.offline import OfflineEngine

    engine = OfflineEngine(LLMConfig())
    engine.setup()
    _, candidates, _ = load_schemas(TagConfig())
    request = LLMRequest(key="x#1", system="", user="", schema=schemas["math"].schema,
                         context={"task": "tag", "text": "$$ 2 + 2 = 4 $$", "domain": "math",
                                  "candidates": {k: candidates[k] for k in ("math_problem_type", "math_technique",
                                                                             "math_notation", "math_difficulty")}})
    code = LLMRequest(key="y#1", system="", user="", schema=schemas["code"].schema,
                      context={"task": "tag", "domain": "code", "candidates": {k: candidates[k] for k in candidates},
                               "text": "import numpy as np\nfrom sklearn.cluster import KMeans\n\n\n"
                                       "def cluster_points(points):\n    return KMeans(3).fit(np.asarray(points))\n"})
    result, coded = engine.generate([request, code])
    parsed = parse_answer(result.text, result.finish_reason, schemas["math"])
    assert json.loads(result.text)["object"] == [] and parsed.problem == "schema_violation"
    answer = parse_answer(coded.text, coded.finish_reason, schemas["code"]).answer
    assert answer["libraries"] == ["numpy", "sklearn"] and "cluster point" in answer["algorithm"]
