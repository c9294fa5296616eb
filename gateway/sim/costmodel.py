"""How long one engine step of the simulated worker takes.

A step's time is the sum of two terms (the arithmetic of ``gateway.planner``):

* **prefill** is compute-bound: about ``2 x params`` FLOPs per prompt token computed in the step,
  at a fraction (``utilisation``) of the GPU's peak; tokens served from the prefix cache are not
  computed and cost nothing. ``planner.prefill_time_s(model, gpu, tokens)``.
* **decode** is memory-bound: every decode step reads all weights once plus the KV of every
  decoding request, ``planner.decode_step_time_s(model, gpu, batch_kv_tokens)``; the batch's
  token count barely matters, its total context does.

A step that loads blocks from a CPU tier (vLLM's ``--kv-offloading-size``) pays their KV bytes over
the host link: ``reload_tokens x kv_bytes_per_token / cpu_offload_bytes_per_s``
(``SimWorkerConfig``), instead of their prefill.

A step that mixes prefill chunks and decodes pays both (vLLM runs them in one forward pass, which
in reality overlaps some of the two; charging both is the conservative choice and keeps TTFT and
TPOT predictable from the two planner functions). A step with no decoding request pays no decode
term. Attention FLOPs over the cached context of a prefill are ignored: they are small next to
the weight FLOPs below ~32K tokens of context.

``LinearCostModel`` is a dependency-free stand-in with explicit coefficients, for tests and for
fitting a sim to measured numbers (e.g. a CPU vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway import planner
from gateway.kvmath import ModelArch
from gateway.planner import GpuSpec

if TYPE_CHECKING:
    from gateway.sim.scheduler import StepPlan


class CostModel(Protocol):
    def prefill_time_s(self, tokens: int) -> float: ...

    def decode_step_time_s(self, batch_kv_tokens: int, batch_size: int = 1) -> float: ...


def step_time_s(
    cost: CostModel, plan: StepPlan, overhead_s: float = 0.0, reload_s_per_token: float = 0.0
) -> float:
    """Modelled duration of one scheduled step; ``reload_s_per_token`` prices the tokens it
    loads from the CPU tier (``plan.reload_tokens``: KV bytes per token / host-link bytes/s)."""
    t = overhead_s + plan.reload_tokens * reload_s_per_token
    if plan.prefill_tokens:
        t += cost.prefill_time_s(plan.prefill_tokens)
    if plan.num_decode_requests:
        t += cost.decode_step_time_s(plan.decode_kv_tokens, plan.num_decode_requests)
    return t


@dataclass(frozen=True)
class LinearCostModel:
    """``prefill = prefill_base_s + prefill_s_per_token x tokens``;
    ``decode = decode_base_s + decode_s_per_kv_token x kv_tokens``."""

    prefill_s_per_token: float = 1e-4
    prefill_base_s: float = 0.0
    decode_base_s: float = 0.01
    decode_s_per_kv_token: float = 0.0

    def prefill_time_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_s_per_token * tokens

    def decode_step_time_s(self, batch_kv_tokens: int, batch_size: int = 1) -> float:
        return self.decode_base_s + self.decode_s_per_kv_token * batch_kv_tokens


class PlannerCostModel:
    """The planner's roofline times for one model on one GPU."""

    def __init__(
        self,
        model: ModelArch,
        gpu: GpuSpec,
        *,
        utilisation: float = 0.5,
        kv_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.utilisation = utilisation
        self.kv_dtype = kv_dtype
        self._prefill = planner.prefill_time_s
        self._decode = planner.decode_step_time_s

    def prefill_time_s(self, tokens: int) -> float:
        return float(self._prefill(self.model, self.gpu, tokens, utilisation=self.utilisation))

    def decode_step_time_s(self, batch_kv_tokens: int, batch_size: int = 1) -> float:
        return float(
            self._decode(
                self.model, self.gpu, batch_kv_tokens, self.kv_dtype, batch_size=max(batch_size, 1)
            )
        )
