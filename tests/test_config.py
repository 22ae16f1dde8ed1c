import pytest

from atlas.config import ConfigError, load_config


def _load_text(tmp_path, text, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path, overrides)


@pytest.mark.parametrize(
    "text, message",
    [
        ("chunk: {max_sentence_tokns: 3}",
         "chunk.max_sentence_tokns: unknown key; did you mean 'max_sentence_tokens'?"),
        ("inptu: {path: x}", "inptu: unknown key; did you mean 'input'?"),
        ("chunk: {domains: {web: {max_tokns: 3}}}",
         "chunk.domains.web.max_tokns: unknown key; did you mean 'max_tokens'?"),
        ("execution: {workers: 0}", "execution.workers: Input should be greater than or equal to 1"),
        ("chunk: {domains: {code: {max_tokens: 9, splitter: words}}}", "chunk.domains.code.splitter"),
    ],
)
def test_bad_keys_and_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        _load_text(tmp_path, text)
    assert message in str(err.value)
    assert str(tmp_path / "c.yaml") in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        _load_text(tmp_path, "chunk: [unclosed")
    with pytest.raises(ConfigError, match="expected a mapping"):
        _load_text(tmp_path, "- a list")


def test_overrides_and_defaults(tmp_path):
    config = _load_text(
        tmp_path,
        "chunk: {domains: {web: {max_tokens: 99}, legal: {max_tokens: 200}}}\ninput: {path: docs.jsonl}",
        ["chunk.max_sentence_tokens=1000", "chunk.domains.legal.max_tokens=300", "input.metadata_fields=[a, b]"],
    )
    assert config.chunk.for_domain("web").max_tokens == 99
    assert config.chunk.for_domain("code").splitter == "lines"  # defaults kept next to the user's domains
    assert config.chunk.for_domain("math").max_tokens == 256
    assert config.chunk.for_domain("legal").max_tokens == 300
    assert config.chunk.for_domain("unknown").max_tokens == 150
    assert config.chunk.max_sentence_tokens == 1000
    assert config.input.metadata_fields == ["a", "b"]
    assert config.input.path == str(tmp_path / "docs.jsonl")  # relative to the config file
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["chunk.max_sentence_tokens"])
    with pytest.raises(ConfigError, match="chunk.nope: unknown key"):
        load_config(None, ["chunk.nope=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("chunk.domains.wbe.max_tokens=100", "chunk.domains.wbe: unknown domain; did you mean 'web'?"),
        ("tag.domain_schemas.cdoe=code", "tag.domain_schemas.cdoe: unknown domain; did you mean 'code'?"),
        ("chunk.domains.web.max_tokens=true", "chunk.domains.web.max_tokens: Value error, must be a number, not a "
                                              "bool"),
        ("chunk.max_sentence_tokens=false", "chunk.max_sentence_tokens: Value error, must be a number, not a bool"),
        ("execution.workers=yes", "execution.workers: Value error, must be a number, not a bool"),
    ],
)
def test_a_set_that_adds_an_unknown_domain_or_gives_a_bool_for_a_number_is_refused(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        _load_text(tmp_path, "input: {path: docs.jsonl}", [override])
    assert message in str(err.value)


def test_a_set_may_change_any_known_domain(tmp_path):
    """Known: the tag schemas' domains, the default chunk domains, input.default_domain, the file's own domains."""
    text = ("chunk: {domains: {legal: {max_tokens: 200}}}\ntag: {domain_schemas: {forum: qa}}\n"
            "input: {default_domain: news}")
    overrides = ["chunk.domains.legal.max_tokens=300", "chunk.domains.forum.max_tokens=120",
                 "chunk.domains.news.max_tokens=90", "chunk.domains.general.max_tokens=80",
                 "chunk.domains.generic.max_tokens=70", "tag.domain_schemas.legal=academic"]
    config = _load_text(tmp_path, text, overrides)
    assert [config.chunk.for_domain(d).max_tokens for d in ("legal", "forum", "news", "general", "generic")] == [
        300, 120, 90, 80, 70]
    assert config.tag.domain_schemas == {"forum": "qa", "legal": "academic"}


def test_shipped_configs_are_valid():
    from conftest import REPO

    for path in (REPO / "configs").glob("*.yaml"):
        load_config(path)
