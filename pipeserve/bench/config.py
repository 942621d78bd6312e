"""The benchmark's config (`bench.*`, beside the served config) and its result row."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.config import ServeConfig
from pipeserve.errors import ConfigError


@dataclass
class BenchConfig:
    workload: str = "single"        # single | concurrent (mixed lengths) | shared_prefix |
    #                                 distinct (long prompts sharing nothing) | cache_ttft |
    #                                 copy (asks to repeat a prose passage) |
    #                                 repetitive (one short sentence repeated: n-gram lookup hits) |
    #                                 steps (no server: one forward per step shape, timed) |
    #                                 vision (chat requests, an image per stream; model=tiny_vlm
    #                                 or a VLM's model.path; bench.mlx_lm=true: mlx-vlm's generate) |
    #                                 ttft (cold long prompts in a row, bursts with and without
    #                                 logit_bias, a first burst after launch; pipeserve/bench/ttft.py)
    streams: int = 1                # concurrent client streams
    requests_per_stream: int = 1    # requests each stream sends back to back
    prompt_words: int = 48          # words per prompt (≈ 64 tokens); concurrent mixes 0.5×–2×
    max_tokens: int = 128           # output tokens per request (EOS suppressed)
    mlx_lm: bool = False            # also run mlx_lm.server on the same model and load
    bare_loop: bool = True          # also time the bare mlx-lm decode loop (single stream ceiling)
    batch_generator: bool = False   # also run the same prompts through mlx-lm's BatchGenerator
    #                                 (the library, no server: the batched ceiling)
    engine_alone: bool = False      # also drive pipeserve's engine with no HTTP (scripts/
    #                                 engine_alone.py: Engine.submit + RequestStreams, the same
    #                                 overrides, output and prompt lengths, each warm-up and
    #                                 timed prompt's, EOS suppressed), so a loss is attributed
    #                                 to the engine or to the HTTP side
    # with engine_alone: the engine alone once more, its streams arriving over as long as the
    # first pipeserve target's timed burst took to arrive (its request log): what HTTP's
    # arrivals cost, apart from the rest of the HTTP side's
    engine_alone_spread: bool = False
    # where pipeserve's engine core runs, one timed target each, in one call: thread (beside
    # the event loop, the default launch) and/or process (its own process: server.isolate=true)
    cores: list[str] = field(default_factory=lambda: ["thread"])
    warmup: bool = True             # one short request per target before timing
    out: str = "bench-out"          # directory for results.md / results.csv
    timeout_s: float = 1800         # per target
    prompt_file: str | None = None  # use this file's text as every prompt (overrides workload text)
    # workload=ttft: cold prompt lengths, sent in order (bench.ttft_cold=[16384,4096])
    ttft_cold: list[int] = field(default_factory=lambda: [16384, 16384, 16384, 16384, 4096])
    ttft_prefix: int = 16           # workload=ttft: tokens every cold prompt shares (a template's)
    ttft_bursts: list[int] = field(default_factory=lambda: [32, 128])   # workload=ttft:
    #                                 simultaneous 76-token arrivals
    ttft_first_burst: int = 0       # workload=ttft: arrivals right after launch (0: none)
    # workload=ttft: bursts (bench.ttft_bursts sizes) whose prompts share a head this long (a
    # system prompt the cache already holds) before their own 76 tokens (0: none)
    ttft_shared_head: int = 0
    # every target serves the model quantized to this many bits by mlx_lm.convert (a copy kept
    # beside the model, named <model>-q<bits>): a 4-bit model's kernels and first bursts
    quantize_bits: int | None = None
    step_context: int = 1024        # workload=steps: tokens already in the cache
    step_width: int = 8             # workload=steps: tokens per row in a verify-shaped forward
    adapters: int = 0               # N random LoRA adapters (rank 8, q/v of every layer) mounted
    #                                 at launch; request i asks for adapter i mod N (model
    #                                 "<name>:<id>"); 0 = the base model
    ranks: int = 2                  # distributed≠none: ranks on this host for the pipeserve target
    launcher: str = "mlx.launch"    # distributed≠none: `mlx.launch --backend ring` (as users


    def __post_init__(self) -> None:
        if self.quantize_bits is not None and self.quantize_bits not in QUANT_BITS:
            raise ConfigError(f"bench.quantize_bits must be one of {QUANT_BITS} (or unset); got "
                              f"{self.quantize_bits}")
        bad = [c for c in self.cores if c not in CORES]
        if bad or not self.cores:
            raise ConfigError(f"bench.cores must list one or more of {', '.join(CORES)}; got "
                              f"{list(self.cores)}")


QUANT_BITS = (2, 3, 4, 5, 6, 8)   # what mlx-lm's affine quantization takes
CORES = {"thread": [], "process": ["server.isolate=true"]}   # a core → its launch overrides


@dataclass
class Row:
    target: str
    workload: str
    streams: int
    requests: int
    output_tokens: int
    wall_s: float
    agg_tok_s: float
    stream_tok_s_p50: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_ms: float
    itl_p95_ms: float
    peak_rss_mb: float
    overrides: str = ""
    prompt_tokens: float = float("nan")     # mean usage.prompt_tokens
    prefill_tok_s: float = float("nan")     # mean prompt_tokens / TTFT (B=1: the prefill rate)
    decode_agg_tok_s: float = float("nan")  # tokens after the first / (last end - first token)
    spec_proposed: int = 0                  # sum of usage.speculation.proposed (timed requests)
    spec_accepted: int = 0
    acceptance: float = float("nan")        # accepted / proposed
    kv_bytes_per_token: float = float("nan")  # the server's pipeserve_kv_bytes_per_token gauge
    errors: int = 0                         # requests the server failed (error event)
    decode_full_tok_s: float = float("nan")  # all streams' tokens while every stream decodes
    host_steal: float = float("nan")        # CPUs' worth the hypervisor took over the timed part
    host_probe_ms: float = float("nan")     # bench/host.py's fixed loop just before it: 1-core speed


@dataclass
class BenchRootConfig(ServeConfig):
    bench: BenchConfig = field(default_factory=BenchConfig)
