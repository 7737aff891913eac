"""The engine's configuration (a deployment's ``engine_kwargs``, what the CLI builds): the workers are built from it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TREE_BLOCK = 63  # positions a per-token int64 bitmask can cover (tree masks)

AttentionBackendName = Literal["auto", "torch_native", "triton", "flashinfer"]
SpecMethod = Literal["eagle", "eagle3", "draft", "ngram", "naive", "mtp"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class SpeculativeConfig(Strict):
    method: SpecMethod
    model: str | None = Field(None, description="draft model / EAGLE head directory (not used by ngram; mtp: "
                              "default the target's own MTP layer)")
    num_steps: int = Field(3, ge=1, le=16, description="draft depth per round")
    topk: int = Field(1, ge=1, le=16, description="branching per draft step (1 = chain)")
    num_draft_tokens: int | None = Field(None, ge=2, description="verified tokens per round incl. the root; "
                                         "default num_steps + 1 for chains")
    draft_tensor_parallel_size: int | None = Field(None, ge=1, description="1 or the target's TP size")
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    simulated_accept_length: float | None = Field(
        None, ge=1.0, description="BENCHMARK ONLY: force this mean accept length; outputs are not the model's")
    adaptive: bool | None = Field(
        None, description="each step drafts the depth (0 = a plain step, up to num_steps) that maximises expected "
        "tokens/s for its batch, from start-up step timings and live acceptance (speculative/adaptive.py). Default: "
        "on for chains where decode steps replay CUDA graphs, off where they run eagerly; chains only (topk 1)")
    depth_tiers: list[int] | None = Field(
        None, description="adaptive: the depths whose graphs are captured at start-up and chosen among (default "
        "every depth 0..num_steps); fewer tiers, fewer graphs")
    catch_up_window: int = Field(
        16, ge=1, le=256, description="adaptive: the draft's inputs of this many plain steps are kept per request; "
        "when they fill, the draft catches up on all but the newest; a round catches up first anyway")
    pause_draft_after: int | None = Field(
        None, ge=0, description="adaptive: after this many plain steps chosen in a row (no probe between, acceptance "
        "measured) the draft is paused: its pending inputs are dropped and steps run exactly what no speculation runs "
        "until the batch reaches a size whose choice is a round; requests that lived through a pause accept fewer "
        "drafts later (their draft KV has holes; outputs are unchanged). Default 2 x catch_up_window; 0: never")

    @model_validator(mode="after")
    def _check(self):
        if self.method == "naive":
            self.num_steps, self.topk = 1, 1
            self.num_draft_tokens = 2
        if self.num_draft_tokens is None:
            self.num_draft_tokens = self.num_steps + 1 if self.topk == 1 else min(self.num_steps * self.topk + 1, 16)
        if self.topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(f"a chain of {self.num_steps} steps verifies at most {self.num_steps + 1} tokens")
        if self.num_draft_tokens > self.num_steps * self.topk + 1:
            raise ValueError("num_draft_tokens exceeds num_steps * topk + 1 tree nodes")
        if self.simulated_accept_length is not None and (self.topk != 1 or self.num_draft_tokens != self.num_steps + 1):
            raise ValueError("simulated_accept_length works on full chains (topk 1, num_draft_tokens = num_steps + 1)")
        # tree masks are one int64 bitmask per token: a round's draft block (its steps' nodes plus the root) and
        # the verified tokens must fit MAX_TREE_BLOCK positions
        if self.topk > 1 and self.num_steps * self.topk + 1 > MAX_TREE_BLOCK:
            raise ValueError(f"a tree round of num_steps * topk + 1 = {self.num_steps * self.topk + 1} draft "
                             f"positions exceeds {MAX_TREE_BLOCK}; lower num_steps or topk")
        if self.num_draft_tokens > MAX_TREE_BLOCK:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} exceeds {MAX_TREE_BLOCK}")
        if self.adaptive and self.topk != 1:
            raise ValueError("adaptive speculation chooses among chain depths: set topk 1, or adaptive false for a "
                             "tree (a tree's depth tiers are not built)")
        if self.depth_tiers is not None:
            tiers = sorted(set(self.depth_tiers))
            if not tiers or tiers[0] < 0 or tiers[-1] != self.num_steps:
                raise ValueError(f"depth_tiers must lie in 0..num_steps and include num_steps ({self.num_steps})")
            self.depth_tiers = tiers
        if self.method in ("eagle", "eagle3", "draft") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs `model` (the draft/head directory)")
        return self

    def resolved_adaptive(self, decode_graphs: bool) -> bool:
        """Whether steps choose their depth: as set, else on for chains whose decode steps replay CUDA graphs."""
        return self.adaptive if self.adaptive is not None else (self.topk == 1 and decode_graphs)

    def tiers(self) -> list[int]:
        """The depths an adaptive engine chooses among."""
        return self.depth_tiers or list(range(self.num_steps + 1))


class EngineConfig(Strict):
    model: str = Field(..., description="HF checkpoint directory of the target model")
    tokenizer: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["ray", "uni"] = Field(
        "ray", description="served engines: where the TP ranks run. ray: a worker actor per GPU, stepped over Ray's "
        "channels (a dead worker is restarted in place); uni: TP=1 only, the worker inside the engine core's own "
        "process (no step message between processes; a worker that dies takes the engine core with it, and a step "
        "that runs past worker_step_timeout_s fails the health check: Serve then replaces the replica)")
    page_size: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=16, description="default: the model's max_position_embeddings")
    max_num_seqs: int = Field(64, ge=1, description="running requests at most")
    max_prefill_tokens: int = Field(8192, ge=16, description="chunked prefill: prompt tokens per step at most "
                                    "(decode rows included, in a step that mixes them: one token budget). vLLM's "
                                    "served default: a burst of arrivals is admitted in fewer steps")
    mixed_decode_rows: int | None = Field(
        None, ge=0, description="a step that prefills also carries the running requests' decode rows (one EXTEND "
        "forward instead of an EXTEND and a DECODE step) when there are at most this many (0: never). Default: "
        "any number where decode steps run eagerly anyway (CPU, CUDA graphs off or refused), none where they replay "
        "CUDA graphs (docs/design.md, Scheduling). Never with speculation")
    scheduler_delay_factor: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="while requests run, arrivals wait to be prefilled until the oldest has waited this "
        "many times the last prefill step's wall, or until they fill a prefill step (vLLM's option of the same "
        "name): arrivals that come spread over a few steps are prefilled in one step instead of stalling every "
        "running request once per piece. 0: admitted at the next step")
    kv_cache_tokens: int | None = Field(None, ge=16, description="KV budget in tokens (default: from memory)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    prefill_attention_backend: AttentionBackendName = Field("auto", description="auto: triton on GPUs, torch_native "
                                                            "(the exact reference) on CPUs")
    decode_attention_backend: AttentionBackendName = Field("auto", description="as prefill_attention_backend")
    verify_attention_mode: Literal["decode", "prefill"] = "decode"
    indexer_key_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="DeepSeek-V3.2: the lightning indexer's key cache. auto: the model dtype (bf16 on GPUs; "
        "exactly what transformers computes); fp8: FP8 e4m3 + a per-token fp32 scale (132 instead of 256 bytes a "
        "token at dim 128; scored FP8 x FP8 with the queries quantized per head: top-k close to auto's, not equal)")
    speculative_config: SpeculativeConfig | None = None
    enable_prefix_caching: bool = Field(True, description="reuse the KV pages of shared prompt prefixes (and of "
                                        "earlier turns' answers) across requests; valid under every speculative "
                                        "method")
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = Field(False, description="launch each step only after the previous one's tokens "
                                           "were read (default: a decode step or speculative round is launched "
                                           "before, so host work hides behind the device's; n-gram rounds never "
                                           "overlap)")
    disable_custom_all_reduce: bool = Field(False, description="TP on GPUs: NCCL for every all-reduce (default: "
                                            "small ones go one-shot over NVLink through symmetric memory)")
    cuda_graph_max_bs: int = Field(256, ge=1, description="larger batches run eagerly (graphs are captured up to "
                                   "min(this, max_num_seqs))")
    cuda_graph_max_prefill_tokens: int = Field(
        2048, ge=0, description="prefill steps of up to this many tokens (and 8 requests) replay CUDA graphs, "
        "captured per token bucket at start-up (with the draft's prefill), so a short prompt's first token does not "
        "wait for the host to launch every layer; 0: prefills run eagerly. Dense attention (triton) only")
    cuda_graph_sampling_kinds: list[Literal["sample", "filter"]] = Field(
        ["sample", "filter"], description="sampling kinds whose decode, round and prefill graphs are captured at "
        "start-up with the greedy ones (sample: temperature only; filter: with top-k / top-p / min-p, which most "
        "checkpoints' generation defaults set, and which hold a sort's buffers in the graph pool). A kind left out "
        "is captured on first use at each batch bucket and draft depth (and prefill bucket), inside a step that "
        "every running stream waits for")
    fuse_speculative_round: bool = Field(True, description="capture a whole speculative round in one CUDA graph "
                                         "(False: draft, verify and draft-extend graphs replayed back to back)")
    max_queue_len: int = Field(1024, ge=1, description="waiting requests beyond this are refused (HTTP 503)")
    worker_step_timeout_s: float = Field(300.0, gt=0, description="a step whose results take longer marks the TP "
                                         "worker actors failed (restarted in place), or with 'uni' fails the health "
                                         "check (default long enough for a first-use graph capture)")
    seed: int = 0
    tuning_cache_dir: str | None = Field(None, description="where the GPU kernel choices timed at start-up are kept "
                                         "for later starts (default: $SPECSERVE_CACHE_DIR, else "
                                         "$XDG_CACHE_HOME/specserve or ~/.cache/specserve); '' times them at every "
                                         "start")

    @field_validator("cuda_graph_sampling_kinds")
    @classmethod
    def _distinct_kinds(cls, kinds: list[str]) -> list[str]:
        if len(set(kinds)) != len(kinds):  # (each would be captured twice)
            raise ValueError(f"cuda_graph_sampling_kinds lists a kind twice: {kinds}")
        return kinds

    @model_validator(mode="after")
    def _check_executor(self):
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank in the engine core's process: "
                             "tensor_parallel_size must be 1 (use 'ray' for tensor parallelism)")
        return self

    def resolved_tuning_cache_dir(self) -> str | None:
        """The directory of the tuning cache, or None when it is off."""
        import os

        if self.tuning_cache_dir is not None:
            return self.tuning_cache_dir or None
        if os.environ.get("SPECSERVE_CACHE_DIR"):
            return os.environ["SPECSERVE_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "specserve")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        # device_count asks NVML and leaves CUDA unstarted (is_available would start the driver, after which a TP
        # worker could no longer widen its CUDA_VISIBLE_DEVICES: workers.distributed.share_node_gpus)
        return "cuda" if torch.cuda.device_count() > 0 else "cpu"

    def resolved_attention_backends(self, device_type: str) -> tuple[str, str]:
        """(prefill, decode) backend names on ``device_type``, ``auto`` resolved."""
        auto = "triton" if device_type == "cuda" else "torch_native"
        return tuple(auto if b == "auto" else b for b in (self.prefill_attention_backend,
                                                          self.decode_attention_backend))

    def resolved_dtype(self, checkpoint_dtype):
        import torch

        from workers.model_config import parse_dtype

        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if self.resolved_device() == "cpu":
            return torch.float32  # CPU half-precision matmuls are slow and inexact
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16
