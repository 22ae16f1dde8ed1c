"""The vllm engine up to the GPU call, against a small fake ``vllm`` module shaped like the real API.

The fake follows vLLM's signatures (``LLM(model, *, tensor_parallel_size, dtype, seed, gpu_memory_utilization,
max_model_len, ...)``, ``LLM.chat(messages, sampling_params, use_tqdm)`` returning ``RequestOutput``-like objects,
``SamplingParams(..., structured_outputs=StructuredOutputsParams(json=...))``). One variant honours the schema
like a working constraint; another ignores it like a version that drops unknown parameters. The last test runs a
real model and only where a GPU, vLLM and ``ATLAS_VLLM_TEST_MODEL`` are all present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from atlas.config import LLMConfig
from atlas.llm import LLMRequest, make_engine
from atlas.llm.engine import strip_extensions
from atlas.llm.vllm_engine import CANARY_SCHEMA, CANARY_VALUE, VLLMEngine

HAIKU = "Crisp leaves drift and fall\nthe maple lets go of red\nwind keeps what it takes"


def minimal_instance(schema: dict):
    """The smallest value a schema accepts (enough for the schemas used here)."""
    if "enum" in schema:
        return schema["enum"][0]
    t = schema.get("type")
    if t == "object":
        return {k: minimal_instance(schema["properties"][k]) for k in schema.get("required", [])}
    if t == "array":
        return [minimal_instance(schema.get("items", {})) for _ in range(schema.get("minItems", 0))]
    return {"string": "", "integer": 0, "number": 0, "boolean": False}.get(t)


def make_fake_vllm(honour: bool = True, legacy: bool = False) -> SimpleNamespace:
    """A fake ``vllm`` and ``vllm.sampling_params``; ``legacy`` has only the pre-0.10.2 GuidedDecodingParams."""
    field = "guided_decoding" if legacy else "structured_outputs"

    class ConstraintParams:  # StructuredOutputsParams / GuidedDecodingParams
        def __init__(self, json=None, regex=None, choice=None, grammar=None, json_object=None, **options):
            if sum(x is not None for x in (json, regex, choice, grammar, json_object)) != 1:
                raise ValueError("exactly one kind of structured outputs constraint")
            self.json = json

    class SamplingParams:
        def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=None, max_tokens=16, **kw):
            self.temperature, self.top_p, self.seed, self.max_tokens = temperature, top_p, seed, max_tokens
            self.constraint = kw.pop(field, None)
            self.ignored = kw  # like versions that drop what they do not know

    class CompletionOutput:
        def __init__(self, text, token_ids, finish_reason):
            self.index, self.text, self.token_ids, self.finish_reason = 0, text, token_ids, finish_reason

    class RequestOutput:
        def __init__(self, request_id, prompt_token_ids, outputs):
            self.request_id, self.prompt, self.prompt_token_ids = request_id, None, prompt_token_ids
            self.outputs, self.finished = outputs, True

    class LLM:
        instances: ClassVar[list] = []

        def __init__(self, model, *, tensor_parallel_size=1, dtype="auto", seed=0, gpu_memory_utilization=0.9,
                     max_model_len=None, **kwargs):
            self.init = dict(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, **kwargs)
            self.calls: list = []
            LLM.instances.append(self)

        def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None, chat_template=None,
                 add_generation_prompt=True, **kwargs):
            conversations = messages if messages and isinstance(messages[0], list) else [messages]
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(conversations)
            assert len(params) == len(conversations)
            self.calls.append((conversations, params, use_tqdm))
            outs = []
            for n, (conv, sp) in enumerate(zip(conversations, params)):
                if any("BOOM" in m["content"] for m in conv):  # e.g. a prompt longer than max_model_len
                    raise ValueError("prompt is too long")
                if honour and sp.constraint is not None:
                    text = json.dumps(minimal_instance(sp.constraint.json))
                else:
                    text = HAIKU
                tokens = list(text.encode())  # one "token" per byte
                finish = "stop"
                if len(tokens) > sp.max_tokens:
                    tokens, finish = tokens[: sp.max_tokens], "length"
                    text = bytes(tokens).decode(errors="ignore")
                prompt_ids = list(range(sum(len(m["content"].split()) for m in conv)))  # one per word
                outs.append(RequestOutput(str(n), prompt_ids, [CompletionOutput(text, tokens, finish)]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.9.2-fake" if legacy else "0.11.0-fake"
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.SamplingParams = SamplingParams
    setattr(sampling_params, "GuidedDecodingParams" if legacy else "StructuredOutputsParams", ConstraintParams)
    vllm.sampling_params = sampling_params
    return SimpleNamespace(vllm=vllm, sampling_params=sampling_params, LLM=LLM)


@pytest.fixture
def install(monkeypatch):
    """install(honour=..., legacy=...) puts a fake vllm into sys.modules for this test only."""

    def _install(**kwargs) -> SimpleNamespace:
        fake = make_fake_vllm(**kwargs)
        monkeypatch.setitem(sys.modules, "vllm", fake.vllm)
        monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake.sampling_params)
        monkeypatch.delitem(sys.modules, "vllm.distributed", raising=False)
        return fake

    return _install


def config(**overrides) -> LLMConfig:
    base = {"engine": "vllm", "model": "/models/tiny", "temperature": 0.3, "top_p": 0.9, "max_tokens": 64, "seed": 7,
            "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_model_len": 4096, "dtype": "bfloat16"}
    return LLMConfig(**(base | overrides))


TAG_SCHEMA = {
    "type": "object",
    "x-atlas-version": 3,
    "properties": {
        "tags": {"type": "array", "minItems": 2, "items": {"type": "string", "enum": ["physics"], "x-note": "n"}},
        "confident": {"type": "boolean"},
    },
    "required": ["tags", "confident"],
    "additionalProperties": False,
}


def request(key: str, user: str = "tag this chunk", schema: dict = TAG_SCHEMA) -> LLMRequest:
    return LLMRequest(key=key, system="You tag text.", user=user, schema=schema)


# --- setup and the canary ----------------------------------------------------------------------


def test_setup_builds_llm_from_config_and_canary_passes(install):
    fake = install(honour=True)
    engine = VLLMEngine(config())
    engine.setup()
    [llm] = fake.LLM.instances
    assert llm.init == {"model": "/models/tiny", "tensor_parallel_size": 2, "dtype": "bfloat16", "seed": 7,
                        "gpu_memory_utilization": 0.5, "max_model_len": 4096}
    [(conversations, params, _)] = llm.calls  # the canary, an unrelated prompt with a forcing schema
    assert conversations == [[{"role": "user", "content": "Write a haiku about autumn."}]]
    assert params[0].constraint.json == CANARY_SCHEMA
    assert "structured_outputs" in engine.api
    engine.close()


def test_canary_raises_when_vllm_ignores_the_constraint(install):
    fake = install(honour=False)
    engine = VLLMEngine(config())
    with pytest.raises(RuntimeError) as err:
        engine.setup()
    msg = str(err.value)
    assert "ignored the structured-output constraint" in msg
    assert "0.11.0-fake" in msg and "StructuredOutputsParams" in msg and CANARY_VALUE in msg
    assert "autumn" not in msg and "Crisp leaves" in msg  # shows what came back
    assert engine._llm is None and len(fake.LLM.instances) == 1  # the model was released


def test_canary_raises_when_answer_is_cut_short(install):
    install(honour=True)
    engine = VLLMEngine(config(max_tokens=5))  # '{"canary": ...}' cannot fit: not the forced object
    with pytest.raises(RuntimeError, match="ignored the structured-output constraint") as err:
        engine.setup()
    assert "finish_reason='length'" in str(err.value)


def test_legacy_guided_decoding_api_when_new_import_is_missing(install):
    fake = install(honour=True, legacy=True)
    engine = VLLMEngine(config())
    engine.setup()  # the canary passes through guided_decoding=GuidedDecodingParams(json=...)
    assert "GuidedDecodingParams" in engine.api
    [result] = engine.generate([request("a")])
    assert json.loads(result.text) == {"tags": ["physics", "physics"], "confident": False}
    assert fake.LLM.instances[0].calls[-1][1][0].ignored == {}


# --- generate ----------------------------------------------------------------------------------


def test_sampling_params_carry_config_and_schema_without_x_keys(install):
    fake = install(honour=True)
    engine = VLLMEngine(config())
    engine.setup()
    schema_before = json.dumps(TAG_SCHEMA, sort_keys=True)
    engine.generate([request("a"), request("b", schema=CANARY_SCHEMA)])
    conversations, params, use_tqdm = fake.LLM.instances[0].calls[-1]
    assert use_tqdm is False
    assert conversations[0] == [{"role": "system", "content": "You tag text."},
                                {"role": "user", "content": "tag this chunk"}]
    for sp in params:
        assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.3, 0.9, 64, 7)
        assert sp.ignored == {}  # nothing passed that this vLLM does not know
    sent = params[0].constraint.json
    assert "x-atlas-version" not in sent and "x-note" not in sent["properties"]["tags"]["items"]
    assert sent == strip_extensions(TAG_SCHEMA) and sent["properties"]["tags"]["minItems"] == 2
    assert params[1].constraint.json == CANARY_SCHEMA  # each request its own schema
    assert json.dumps(TAG_SCHEMA, sort_keys=True) == schema_before  # the caller's schema is untouched


def test_strip_extensions_recurses_into_lists():
    schema = {"anyOf": [{"type": "string", "x-a": 1}, {"type": "null"}], "x-b": {"y": 2}, "enum-x-": 1}
    assert strip_extensions(schema) == {"anyOf": [{"type": "string"}, {"type": "null"}], "enum-x-": 1}


def test_results_in_order_with_finish_reason_and_token_counts(install):
    fake = install(honour=True)
    engine = VLLMEngine(config(max_tokens=40))  # room for the canary (28 bytes), not for a tag answer (51)
    engine.setup()
    short = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    results = engine.generate([request("k1", "one two"), request("k2", schema=short), request("k3", "x")])
    assert [r.key for r in results] == ["k1", "k2", "k3"]
    assert [len(c[0]) for c in fake.LLM.instances[0].calls] == [1, 3]  # the canary, then one batched call
    r1, r2, r3 = results
    assert (r2.text, r2.finish_reason, r2.error) == ('{"ok": false}', "stop", None)
    assert r2.tokens_out == len('{"ok": false}') and r2.tokens_in == 3 + 3  # system + user words
    assert (r1.finish_reason, r1.tokens_out, r1.tokens_in) == ("length", 40, 3 + 2)
    assert r1.text == '{"tags": ["physics", "physics"], "confident": false}'[:40]  # cut: the caller rejects it
    assert r3.tokens_in == 3 + 1


def test_batch_failure_falls_back_to_per_request_errors(install):
    fake = install(honour=True)
    engine = VLLMEngine(config())
    engine.setup()
    results = engine.generate([request("a"), request("b", "BOOM " * 3), request("c")])
    assert [r.key for r in results] == ["a", "b", "c"]
    assert results[0].error is None and json.loads(results[0].text)["tags"] == ["physics", "physics"]
    assert results[2].error is None and results[2].finish_reason == "stop"
    assert results[1].text is None and results[1].error.startswith("engine_error: ")
    assert "prompt is too long" in results[1].error
    calls = fake.LLM.instances[0].calls
    assert [len(c[0]) for c in calls] == [1, 3, 1, 1, 1]  # canary, the failed batch, then one by one


def test_bad_schema_fails_only_its_request(install):
    install(honour=True)
    engine = VLLMEngine(config())
    engine.setup()
    real_cls = engine._params_cls

    def picky(json):
        if "bad" in json:
            raise ValueError("bad schema")
        return real_cls(json=json)

    engine._params_cls = picky
    results = engine.generate([request("a"), request("b", schema={"bad": True})])
    assert results[0].error is None
    assert results[1].error == "engine_error: ValueError: bad schema"


def test_close_releases_the_model(install):
    install(honour=True)
    engine = VLLMEngine(config())
    engine.setup()
    engine.close()
    assert engine._llm is None
    engine.close()  # twice is fine
    with pytest.raises(RuntimeError, match="before setup"):
        engine.generate([request("a")])


# --- without vllm ------------------------------------------------------------------------------


def test_module_imports_without_vllm_and_setup_gives_install_hint():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # makes `import vllm` fail even where it is installed
        "from atlas.config import LLMConfig\n"
        "from atlas.llm import make_engine\n"
        "engine = make_engine(LLMConfig(engine='vllm'))\n"
        "assert type(engine).__name__ == 'VLLMEngine' and engine.name == 'vllm'\n"
        "try:\n"
        "    engine.setup()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert "pip install 'atlas-concepts[gpu]'" in out.stdout
    assert "GPU machine" in out.stdout


def test_setup_without_vllm_in_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    engine = make_engine(config())
    assert isinstance(engine, VLLMEngine)
    with pytest.raises(RuntimeError, match=r"pip install 'atlas-concepts\[gpu\]'"):
        engine.setup()


# --- a real model --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_vllm_with_tiny_model():
    """Set ATLAS_VLLM_TEST_MODEL to a local model directory (any small chat model) to run this on a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("vllm")
    model = os.environ.get("ATLAS_VLLM_TEST_MODEL")
    if not model or not Path(model).exists():
        pytest.skip("ATLAS_VLLM_TEST_MODEL does not name a local model path")
    engine = VLLMEngine(LLMConfig(engine="vllm", model=model, max_tokens=128, max_model_len=2048,
                                  gpu_memory_utilization=0.5))
    engine.setup()  # loads the model and runs the real canary
    try:
        schema = {"type": "object", "properties": {"topic": {"type": "string", "enum": ["physics", "cooking"]}},
                  "required": ["topic"], "additionalProperties": False, "x-atlas": "stripped"}
        results = engine.generate([
            request("p", "Text: 'Quarks are bound by the strong force.' Which topic?", schema),
            request("c", "Text: 'Fold the egg whites into the batter.' Which topic?", schema),
        ])
        for r in results:
            assert r.error is None and r.finish_reason == "stop" and r.tokens_in > 0 and r.tokens_out > 0
            assert json.loads(r.text)["topic"] in {"physics", "cooking"}
    finally:
        engine.close()
