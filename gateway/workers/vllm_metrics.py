"""Read the few vLLM metrics routing needs from a worker's Prometheus text exposition.

Every worker's page is read every few seconds, so this uses ``promtext.scan``, the fast and
tolerant reader of the few wanted families (see ``gateway/promtext.py`` for the measurement
against prometheus-client's full parser), and folds the samples of several engines into one
``VllmStats``.
"""

from __future__ import annotations

from gateway.promtext import scan, scan_labels
from gateway.workers.worker import VllmStats

_WANTED = frozenset({
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # the name before vLLM 0.10
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",  # present only with LoRA enabled
})


def parse_vllm_metrics(text: str) -> VllmStats:
    sums: dict[str, float] = {}
    kv_max = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    lora = False
    for name, labels, value in scan(text, "vllm:", _WANTED):
        if name == "vllm:lora_requests_info":
            lora = True
        elif name == "vllm:cache_config_info":
            info = scan_labels(labels)
            block_size = _int_or_none(info.get("block_size"))
            num_blocks = _int_or_none(info.get("num_gpu_blocks"))
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            kv_max = max(kv_max, value)  # several engines: the fullest one is what matters
        else:
            sums[name] = sums.get(name, 0.0) + value
    return VllmStats(
        running=int(sums.get("vllm:num_requests_running", 0.0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0.0)),
        kv_usage_ratio=kv_max,
        prefix_cache_queries_tokens=sums.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_cache_hits_tokens=sums.get("vllm:prefix_cache_hits_total", 0.0),
        block_size_tokens=block_size,
        num_gpu_blocks=num_blocks,
        lora_enabled=lora,
    )


def _int_or_none(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(float(v))
    except ValueError:
        return None
