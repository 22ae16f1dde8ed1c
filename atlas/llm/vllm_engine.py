"""Offline batched inference with ``vllm.LLM`` on local GPUs.

Structured outputs, as of the vLLM sources and docs checked (vllm-project/vllm ``vllm/sampling_params.py``,
``examples/features/structured_outputs/structured_outputs_offline.py``, docs.vllm.ai "Structured Outputs"):
``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` with ``StructuredOutputsParams``
from ``vllm.sampling_params``, added in vLLM 0.10.2 (PR #22772). The older
``SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))`` was deprecated then and removed in 0.12;
it is used only where the new import is missing. Some versions ignore what they do not know, so ``setup()``
runs a canary request that only a working constraint can answer, and refuses to run otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import json

from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult, strip_extensions

CANARY_VALUE = "q7-canary-1593"
CANARY_SCHEMA = {
    "type": "object",
    "properties": {"canary": {"type": "string", "enum": [CANARY_VALUE]}},
    "required": ["canary"],
    "additionalProperties": False,
}
CANARY_PROMPT = "Write a haiku about autumn."  # unrelated on purpose: a free-running model writes a haiku


def _structured_output_api(vllm) -> tuple[type, str, str]:
    """(params class, SamplingParams field, description): the current API, else the pre-0.10.2 one."""
    try:
        from vllm.sampling_params import StructuredOutputsParams

        api = "SamplingParams(structured_outputs=StructuredOutputsParams(json=...))"
        return StructuredOutputsParams, "structured_outputs", api
    except ImportError:
        pass
    try:
        from vllm.sampling_params import GuidedDecodingParams

        api = "SamplingParams(guided_decoding=GuidedDecodingParams(json=...))"
        return GuidedDecodingParams, "guided_decoding", api
    except ImportError as e:
        raise RuntimeError(f"vLLM {getattr(vllm, '__version__', '?')} has neither StructuredOutputsParams nor "
                           "GuidedDecodingParams in vllm.sampling_params; cannot constrain answers") from e


class VLLMEngine(LLMEngine):
    name = "vllm"
    use_tqdm = False  # a caller that wants vLLM's progress bar sets this on the instance

    def __init__(self, config):
        super().__init__(config)
        self._vllm = None
        self._llm = None
        self._params_cls = None
        self._params_field = ""
        self.api = ""  # which structured-output API is in use, for messages and logs

    def setup(self) -> None:
        """Load the model, then prove with the canary that the JSON-schema constraint is really applied."""
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(f"the vllm engine needs vLLM ({e}); on a GPU machine run: "
                               "pip install 'atlas-concepts[gpu]'") from e
        self._vllm = vllm
        self._params_cls, self._params_field, self.api = _structured_output_api(vllm)
        c = self.config
        self._llm = vllm.LLM(model=c.model, tensor_parallel_size=c.tensor_parallel_size,
                             gpu_memory_utilization=c.gpu_memory_utilization, max_model_len=c.max_model_len,
                             dtype=c.dtype, seed=c.seed)
        try:
            self._check_canary()
        except Exception:
            self.close()
            raise

    def _check_canary(self) -> None:
        [res] = self.generate([LLMRequest(key="canary", system="", user=CANARY_PROMPT, schema=CANARY_SCHEMA)])
        try:
            ok = res.error is None and json.loads(res.text or "") == {"canary": CANARY_VALUE}
        except ValueError:
            ok = False
        if not ok:
            got = res.error or f"{(res.text or '')[:200]!r} (finish_reason={res.finish_reason!r})"
            raise RuntimeError(
                f"vLLM {getattr(self._vllm, '__version__', '?')} ignored the structured-output constraint "
                f"({self.api}): a canary request whose schema allows only {{\"canary\": \"{CANARY_VALUE}\"}} "
                f"returned {got}. Stopping rather than producing unconstrained tags.")

    def _sampling_params(self, schema: dict):
        c = self.config
        constraint = self._params_cls(json=strip_extensions(schema))
        return self._vllm.SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens,
                                         seed=c.seed, **{self._params_field: constraint})

    @staticmethod
    def _messages(r: LLMRequest) -> list[dict]:
        system = [{"role": "system", "content": r.system}] if r.system else []
        return system + [{"role": "user", "content": r.user}]

    @staticmethod
    def _result(key: str, out) -> LLMResult:
        o = out.outputs[0]
        return LLMResult(key, text=o.text, finish_reason=o.finish_reason,
                         tokens_in=len(out.prompt_token_ids or ()), tokens_out=len(o.token_ids or ()))

    def _chat(self, jobs: list[tuple[int, list, object]]) -> list:
        outs = self._llm.chat([m for _, m, _ in jobs], [p for _, _, p in jobs], use_tqdm=self.use_tqdm)
        if len(outs) != len(jobs):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(jobs)} requests")
        return outs

    def generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        """One ``llm.chat`` call for the batch; if vLLM raises, one call per request so only the bad one fails."""
        if self._llm is None:
            raise RuntimeError("VLLMEngine.generate() called before setup()")
        results: list[LLMResult | None] = [None] * len(requests)
        jobs = []
        for i, r in enumerate(requests):
            try:
                jobs.append((i, self._messages(r), self._sampling_params(r.schema)))
            except Exception as e:  # noqa: BLE001 -- e.g. a schema the params class rejects: fail this request only
                results[i] = LLMResult(r.key, error=f"engine_error: {type(e).__name__}: {e}")
        if jobs:
            try:
                for (i, _, _), out in zip(jobs, self._chat(jobs)):
                    results[i] = self._result(requests[i].key, out)
            except Exception:  # noqa: BLE001 -- find the request vLLM refused; the others still get answers
                for job in jobs:
                    i = job[0]
                    try:
                        results[i] = self._result(requests[i].key, self._chat([job])[0])
                    except Exception as e:  # noqa: BLE001
                        results[i] = LLMResult(requests[i].key, error=f"engine_error: {type(e).__name__}: {e}")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Drop the model and hand its GPU memory back (vLLM has no single call for it; this is its own recipe)."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()  # V1: the engine core runs in its own process
        del llm
        with contextlib.suppress(Exception):
            from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
