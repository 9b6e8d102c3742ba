"""The joint serving benchmark's full config: every field, its default and its meaning.

Other configs start from this one (`load_config` of this file) and change a few fields.
Any field can be overridden on the command line, e.g. `--config.engine.page_size=32`.
A chat-like Poisson workload on the embedded SmolLM2-135M; sized for an accelerator, so on a
CPU prefer configs/serve_demo.py.
"""

from ml_collections import ConfigDict, config_dict


def get_config() -> ConfigDict:
    config = ConfigDict()
    config.name = "default"  # the run's label in tables, file names and plots

    config.model = ConfigDict()
    config.model.name = "smollm2-135m"  # the embedded model, a .gguf file or an HF directory
    config.model.dtype = "float32"  # weights and compute dtype: float32, bfloat16, float16

    config.engine = ConfigDict()
    config.engine.kv_layout = "paged"  # paged (on-demand pages) or contiguous (max_len per seq)
    config.engine.page_size = 16  # P, tokens per KV page
    # KV pool size in MiB; None: room for max_num_seqs sequences of max_model_len tokens.
    config.engine.kv_budget_mb = config_dict.placeholder(float)
    config.engine.num_pages = config_dict.placeholder(int)  # page count; overrides kv_budget_mb
    config.engine.kv_dtype = config_dict.placeholder(str)  # K/V storage dtype; None: the model's
    config.engine.max_num_seqs = 16  # most sequences running at once (decode rows per step)
    config.engine.max_num_batched_tokens = 512  # per-step token budget (decode + prefill)
    config.engine.max_prefill_chunk = 256  # longest prefill chunk of one sequence per step
    config.engine.max_prefill_seqs = 4  # most sequences prefilling in one step
    config.engine.min_chunk_bucket = 16  # smallest padded prefill-token total of a step
    config.engine.chunk_bucket_factor = 4  # padded totals: min_chunk_bucket * factor^k
    # Cut a step's prefill to a bucket when padding to the next would exceed this fraction
    # (the rest runs next step); None: never.
    config.engine.prefill_padding_limit = config_dict.placeholder(float)
    config.engine.max_model_len = 2048  # context limit (prompt + output); None: the model's
    config.engine.scheduler_policy = "fcfs"  # fcfs, priority, lpm (prefix-aware), fair (tenants)
    config.engine.enable_prefix_cache = True  # share full prompt pages across requests
    # Which unreferenced cached page goes first: lru, or fair_share (that of the tenant holding
    # the most cached pages: a tenant flooding the cache evicts its own pages first).
    config.engine.prefix_cache_eviction = "lru"
    # A tenant whose running sequences hold this fraction of the pool admits no more while
    # another tenant's requests wait; None: no limit.
    config.engine.max_tenant_page_share = config_dict.placeholder(float)
    # While another tenant is active (an unfinished request now or within contention_window_s),
    # a tenant served more than it recently gets prefill chunks of at most this many tokens;
    # None: off.
    config.engine.contended_prefill_chunk = config_dict.placeholder(int)
    config.engine.contention_window_s = 15.0  # seconds a tenant stays active after a request
    # Requests naming a cache_salt share pages across tenants; with this, a tenant hits such a
    # page only once it computed it itself (no hit's speed reveals another tenant's prompt).
    config.engine.hide_shared_prefix_hits = False
    # recompute, swap (to host memory: the host tier when tiers are on) or auto (per sequence,
    # whichever a cost model estimates cheaper)
    config.engine.preemption_mode = "recompute"
    config.engine.watermark = 0.01  # fraction of pages kept free when admitting
    config.engine.scrub_freed_pages = False  # zero pages when they are freed
    # auto (Pallas on GPU/TPU, the native kernel on CPU), reference, pallas or native
    config.engine.attention_impl = "auto"
    config.engine.matmul_impl = "auto"  # auto (native CPU kernel in decode steps), xla, native
    # The KV controller consulted every step (kvjax.scheduler.controller): fixed (the settings
    # above), admission, preemption, tiers, retention, codec, prefix or joint; and its options
    # (e.g. its measured KL tables, retention_kl={budget: kl} and demote_kl={bits: kl}).
    config.engine.controller = "fixed"
    config.engine.controller_options = ConfigDict()

    config.kv = ConfigDict()
    config.kv.codec = "none"  # KV codec: none, int8, int4, int2, fp8_e4m3, fp8_e5m2, kivi4, kivi2
    config.kv.codec_options = ConfigDict()  # codec keyword options, e.g. group, residual
    # Token retention policy (kvjax.kv.retention): none, streaming, h2o, snapkv, quest, and the
    # presses tova, knorm, expected_attention, observed_attention (kvjax.kv.presses). All but
    # none need the paged layout; docs/compatibility.md lists what each composes with.
    config.kv.retention = "none"
    # Tokens each sequence keeps (quest: reads per decode query). A value in (0, 1) is a
    # fraction of engine.max_model_len, floored to whole tokens. None for retention none.
    config.kv.budget = config_dict.placeholder(float)
    config.kv.retention_options = ConfigDict()  # policy keyword options, e.g. num_sinks, window
    # Non-prefix context reuse (kvjax.scheduler.context) of prompts with reusable chunks (the
    # rag workload's documents): full (recompute, exact), none, ape, epic or cacheblend.
    config.kv.context_reuse = "full"
    config.kv.context_reuse_options = ConfigDict()  # ape temperature, epic num_tokens, ratio

    # Host and disk tiers below the device pool (kvjax.memory.tiers). With a host tier,
    # evicted prefix-cache pages spill to host (then disk) and load back on a later hit, and
    # swaps go through the tiers' checked transfers.
    # Speculative decoding (kvjax.scheduler.spec): none, ngram (prompt lookup) or sparse_self
    # (the model drafts over attention sinks + a recent window of its own pages, MagicDec).
    config.spec = ConfigDict()
    config.spec.method = "none"
    config.spec.num_draft_tokens = 4  # gamma: drafts verified per step
    config.spec.options = ConfigDict()  # drafter options: sparse_self num_sinks, window (tokens)
    config.spec.adaptive = False  # draft length follows each sequence's last acceptance

    config.tiers = ConfigDict()
    # Host tier MiB; None or 0: no tiers (swap preemption then uses unbounded host memory).
    config.tiers.host_budget_mb = config_dict.placeholder(float)
    config.tiers.disk_budget_mb = 0.0  # disk tier MiB (needs a host tier); 0: no disk tier
    config.tiers.disk_dir = config_dict.placeholder(str)  # disk tier parent dir; None: tmp
    config.tiers.transfer_layout = "page_first"  # page_first (chunks of pages) or per_page
    config.tiers.max_chunk_pages = 64  # most pages in one page-first transfer
    config.tiers.timeout_polls = 64  # engine steps a transfer may stay in flight
    config.tiers.max_inflight_loads = 4  # most sequences loading from the tiers at once
    # Inputs of preemption_mode=auto's cost model; None: measured.
    config.tiers.swap_bandwidth_bytes_per_s = config_dict.placeholder(float)
    config.tiers.recompute_tokens_per_s = config_dict.placeholder(float)
    config.tiers.fault_injection = ConfigDict()  # seeded faults in tier transfers (host tier)
    config.tiers.fault_injection.transfer_failure_rate = 0.0  # fraction of transfers that fail
    config.tiers.fault_injection.corruption_rate = 0.0  # fraction corrupted (checksum catches)
    config.tiers.fault_injection.delay_rate = 0.0  # fraction landing delay_polls steps late
    config.tiers.fault_injection.delay_polls = 3  # how late a delayed transfer lands
    config.tiers.fault_injection.seed = 0  # which transfers fail, and which bytes flip

    config.workload = ConfigDict()
    config.workload.name = "poisson"  # a generator in kvjax.bench.workloads.WORKLOADS
    config.workload.seed = 0  # makes prompts, lengths and arrivals reproducible
    config.workload.num_requests = 64  # requests in the run
    config.workload.params = ConfigDict()  # the generator's keyword parameters
    config.workload.params.rate = 4.0  # arrivals per second (inf: all at t=0)
    config.workload.params.prompt_len = 256  # median prompt tokens (log-normal)
    config.workload.params.prompt_max = 1024  # longest prompt
    config.workload.params.output_len = 128  # median output tokens (log-normal)
    config.workload.params.output_max = 512  # longest output
    config.workload.tenant_weights = ()  # per-tenant traffic shares; (): one tenant, as generated
    config.workload.tenant_priorities = ()  # per-tenant priority (larger first); (): all 0
    # per-tenant SLO (ttft_s, tpot_s, kl_budget) a controller serves; (): the slo section's
    config.workload.tenant_slos = ()

    config.sampling = ConfigDict()
    config.sampling.temperature = 0.0  # 0: greedy (warm-up compiles greedy shapes only)

    config.slo = ConfigDict()
    config.slo.ttft_s = 2.0  # a request meets the SLO with TTFT at most this ...
    config.slo.tpot_s = 0.1  # ... and time per output token at most this
    # the most KL (nats per token vs exact KV) a KV controller may spend on a request; 0:
    # exact only; None: unbounded
    config.slo.kl_budget = 0.0

    # Record a KV-semantic trace (kvjax.trace): <run>.trace.json, opens in ui.perfetto.dev.
    config.trace = False
    config.clock = "real"  # real (wall clock) or simulated (the cost model below)
    # Simulated step seconds = overhead + per_token * T + per_context_token * S (+ swaps), T
    # the step's padded tokens, S the KV tokens its rows read. The defaults are a rounded
    # fit_step_cost fit of a real-clock serve_demo run (SmolLM2-135M, float32) on a 2-core
    # x86 CPU shared with other jobs.
    config.sim = ConfigDict()
    config.sim.step_overhead_s = 0.1  # fixed cost of a step
    config.sim.per_token_s = 0.006  # per padded token in the step (T)
    config.sim.per_context_token_s = 2e-5  # per KV token the step's rows attend to (S)
    # device <-> host bandwidth: swaps, and with tiers every spill and load (disk traffic is
    # not charged)
    config.sim.host_bytes_per_s = 10e9

    config.quality = ConfigDict()
    config.quality.enabled = True  # score non-exact KV variants against exact KV
    config.quality.num_prompts = 4  # workload prompts scored
    config.quality.prompts = "first"  # which: "first" (arrival order) or "longest"
    config.quality.num_tokens = 32  # greedy tokens generated and scored per prompt

    config.energy_profile = "cpu"  # kvjax.bench.energy profile: cpu, h100, h200, tpu_v5e
    config.sweep = []  # override sets, one run each: [{"engine.page_size": 32}, ...]
    return config
