"""Serve a model over an OpenAI-compatible HTTP API (kvjax.server).

  python scripts/serve.py                                   # embedded SmolLM2, 127.0.0.1:8000
  python scripts/serve.py --config=configs/serve_tiers.py --port 8080
  python scripts/serve.py --model path/to/hf_dir --max_num_seqs 16 --page_size 32
  python scripts/serve.py --also_serve smollm2-bf16=embedded:bfloat16:int8 --pool_budget_mb 1200
  python scripts/serve.py --trace_path=runs/serve.trace.json   # KV trace written on shutdown
  python scripts/serve.py --api_key_file=keys.txt       # lines 'KEY TENANT'; fair admission

--config is a serve_bench config file (its model, engine, kv and tiers sections; the workload
is not used); any field can be overridden as --config.engine.page_size=32, and the common
engine fields have flags of their own. SIGTERM or Ctrl-C stops admitting, lets in-flight
requests finish for up to --drain_timeout_s, then exits 0.

--also_serve adds models that share one device budget with the first (weights and KV pages
in one arena, `kvjax.MultiModelEngine`); a request's `model` field picks one.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
from ml_collections import config_flags

import kvjax
from kvjax.bench import runner
from kvjax.server import ServerConfig, serve
from kvjax.server.kv_state import read_affinity_secret

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/serve_demo.py",
                                "Engine / KV config file (configs/serve_*.py).",
                                lock_config=True)
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or a "
                    ".gguf; None: the config's model.name.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "Weights and compute dtype; None: the config's model.dtype.")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "The model id clients send; None: the model's "
                    "name.")
flags.DEFINE_integer("max_waiting_requests", 128, "Sequences (n per request) accepted without "
                     "a first token yet; beyond it requests get 429 with Retry-After.")
flags.DEFINE_integer("max_waiting_tokens", 1 << 16, "Prompt tokens of those requests; beyond "
                     "it requests get 429 (an empty queue takes any one request).")
flags.DEFINE_string("affinity_secret_file", None, "A file holding the key of /kv_state's "
                    "affinity digests, the same for a router and its replicas (default: a "
                    "random key per process, so a router finds no tenant's pages).")
flags.DEFINE_list("api_key", [], "API keys clients must send (Authorization: Bearer); their "
                  "requests run as the default tenant.")
flags.DEFINE_string("api_key_file", None, "A file of lines 'KEY TENANT' (# comments): each "
                    "key's requests run as its tenant. With keys, the scheduler policy "
                    "defaults to 'fair'.")
flags.DEFINE_bool("allow_client_tenant", None, "Let clients name a tenant (X-Tenant, or the "
                  "body's user), nested in their key's; default: only without API keys.")
flags.DEFINE_bool("logprobs_after_temperature", False, "Report a sampled request's logprobs "
                  "after its temperature (default: the model's own distribution).")
flags.DEFINE_float("drain_timeout_s", 30.0, "On SIGTERM, how long in-flight requests may run.")
flags.DEFINE_bool("warmup", True, "Compile every greedy step shape before serving.")
flags.DEFINE_bool("warmup_sampling", False, "Also compile the sampled variants (temperature "
                  "> 0, top-k / top-p; OpenAI's default temperature is 1), three times the "
                  "programs; otherwise the first sampled requests compile them.")
flags.DEFINE_string("log_level", "info", "uvicorn's log level.")
flags.DEFINE_string("trace_path", None, "Record a KV-semantic trace (config.trace) and write "
                    "it here as Perfetto JSON on shutdown; None: no trace.")
# Common engine fields; None keeps the config's value.
flags.DEFINE_integer("page_size", None, "Tokens per KV page.")
flags.DEFINE_integer("max_num_seqs", None, "Most sequences running at once.")
flags.DEFINE_integer("max_num_batched_tokens", None, "Per-step token budget.")
flags.DEFINE_integer("max_prefill_chunk", None, "Longest prefill chunk per sequence and step.")
flags.DEFINE_integer("max_model_len", None, "Context length (prompt + output).")
flags.DEFINE_float("kv_budget_mb", None, "Device KV pool size in MiB.")
flags.DEFINE_string("scheduler_policy", None, "fcfs, priority, lpm or fair.")
flags.DEFINE_string("preemption_mode", None, "recompute, swap or auto.")
flags.DEFINE_bool("enable_prefix_cache", None, "Share full prompt pages across requests.")
flags.DEFINE_string("kv_codec", None, "KV codec: none, int8, int4, fp8_e4m3, kivi4, ...")
flags.DEFINE_list("also_serve", [], "More models on one shared budget with the first, each "
                  "NAME=MODEL:DTYPE[:KV_CODEC] (MODEL as --model; 'embedded' for the embedded "
                  "one), routed by the request's `model`.")
flags.DEFINE_float("pool_budget_mb", None, "With --also_serve: device MiB for every model's "
                   "weights and KV; None: their weights plus the config's KV budget.")
flags.DEFINE_enum("pool_policy", "elastic", ["elastic", "static"], "With --also_serve: how "
                  "the models share the budget (kvjax.memory.frames).")

_ENGINE_FLAGS = ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                 "max_model_len", "kv_budget_mb", "scheduler_policy", "preemption_mode",
                 "enable_prefix_cache")


def api_keys_from_flags() -> dict[str, str | None]:
    """--api_key (default tenant) and --api_key_file's 'KEY TENANT' lines."""
    keys: dict[str, str | None] = dict.fromkeys(FLAGS.api_key)
    if FLAGS.api_key_file:
        with open(FLAGS.api_key_file) as f:
            for number, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) != 2:
                    raise app.UsageError(f"{FLAGS.api_key_file}:{number}: expected 'KEY TENANT'")
                keys[fields[0]] = fields[1]
    return keys


def config_from_flags():
    """The config file with the engine flags (and --model / --dtype) applied; with API keys
    (tenants), fair admission (unless --scheduler_policy says otherwise) and fair-share
    prefix-cache eviction."""
    overrides = {f"engine.{name}": FLAGS[name].value for name in _ENGINE_FLAGS
                 if FLAGS[name].value is not None}
    if FLAGS.api_key or FLAGS.api_key_file:  # tenants: fair admission, fair cache shares
        if FLAGS.scheduler_policy is None:
            overrides["engine.scheduler_policy"] = "fair"
        overrides.setdefault("engine.prefix_cache_eviction", "fair_share")
    for field, value in (("kv.codec", FLAGS.kv_codec), ("model.name", FLAGS.model),
                         ("model.dtype", FLAGS.dtype)):
        if value is not None:
            overrides[field] = value
    if FLAGS.trace_path:
        overrides["trace"] = True
    return runner.apply_overrides(FLAGS.config, {"name": FLAGS.config.name, **overrides})


def multi_model_engine(name: str, model: kvjax.Model, engine_config: kvjax.EngineConfig
                       ) -> kvjax.MultiModelEngine:
    """The first model and every --also_serve one on one budget."""
    specs = {name: kvjax.ModelSpec(model, engine_config)}
    for entry in FLAGS.also_serve:
        extra_name, _, spec = entry.partition("=")
        path, dtype, *codec = spec.split(":")
        extra = kvjax.load_model(None if path == "embedded" else path, dtype=dtype)
        config = dataclasses.replace(engine_config, kv_codec=codec[0] if codec else "none",
                                     kv_codec_options={})
        specs[extra_name] = kvjax.ModelSpec(extra, config)
    if FLAGS.pool_budget_mb is not None:
        budget = int(FLAGS.pool_budget_mb * (1 << 20))
    else:
        weights = sum(s.model.nbytes for s in specs.values())
        budget = weights + (engine_config.kv_budget_bytes or 256 << 20)
    return kvjax.MultiModelEngine(specs, kvjax.PoolConfig(budget, policy=FLAGS.pool_policy))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = config_from_flags()
    model = kvjax.load_model(config.model.name, dtype=config.model.dtype)
    name = FLAGS.served_model_name or config.model.name
    engine_config = runner.engine_config_from(config)
    if FLAGS.also_serve:
        engine = multi_model_engine(name, model, engine_config)
        if FLAGS.warmup:
            engine.warmup()
    else:
        engine = kvjax.Engine(model, engine_config)
        if FLAGS.warmup:
            print(f"warming up: {engine.warmup(sampling=FLAGS.warmup_sampling)} programs "
                  f"compiled")
    serve(engine, ServerConfig(model_name=name, max_waiting=FLAGS.max_waiting_requests,
                               max_waiting_tokens=FLAGS.max_waiting_tokens,
                               drain_timeout_s=FLAGS.drain_timeout_s,
                               api_keys=api_keys_from_flags(),
                               allow_client_tenant=FLAGS.allow_client_tenant,
                               logprobs_after_temperature=FLAGS.logprobs_after_temperature,
                               affinity_secret=read_affinity_secret(
                                   FLAGS.affinity_secret_file)),
          host=FLAGS.host, port=FLAGS.port, log_level=FLAGS.log_level)
    if FLAGS.trace_path:  # serve returns once drained: the trace is complete.
        engine.export_trace(FLAGS.trace_path)
        print(f"wrote {FLAGS.trace_path}")


if __name__ == "__main__":
    app.run(main)
