"""Which KV behaviours compose: the one table of refusals, and the check that applies it.

Every behaviour an engine can run with is a `Feature`. Any two features compose unless
`REFUSED` lists the pair, with the one-sentence reason the combination cannot mean what it
says. Features of one `group` exclude each other by construction (one codec, one retention
policy, one preemption mode), so they form no pairs.

    compat.check(config, on_mesh=mesh is not None)                  # Engine / EngineConfig
    compat.check(config, on_mesh=..., uses=(Feature.SNAPSHOT,))     # save / restore
    compat.check_model(config, model.config)                        # Engine

A model's architecture can refuse a feature too: `MODEL_REFUSED` pairs a `ModelTrait` with a
`Feature` and the reason.

`docs/compatibility.md` is the table rendered as a matrix (scripts/make_compat_docs.py), and
tests/engine/test_compatibility.py runs every pair the table lets through.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable
from typing import Any

from kvjax.config import KVLayout
from kvjax.kv import quantized
from kvjax.kv.retention import make_retention
from kvjax.memory.precision import MIXED_CODEC, MixedOptions
from kvjax.scheduler.context import make_strategy
from kvjax.scheduler.preemption import PreemptionMode
from kvjax.scheduler.replay import is_recorded

__all__ = ["Feature", "MODEL_REFUSED", "ModelTrait", "REFUSED", "check", "check_model",
           "features_of", "model_traits", "pairs", "refusal", "render_markdown"]


class Feature(enum.Enum):
    """A behaviour an engine runs with; `group` names the features it excludes."""

    INT8 = "int8"
    KIVI = "kivi"
    KIVI_RESIDUAL = "kivi_residual"
    LOWRANK = "lowrank"
    STREAMING = "streaming"
    STREAMING_ROTATED = "streaming_rotated"
    H2O = "h2o"
    SNAPKV = "snapkv"
    TOVA = "tova"
    KNORM = "knorm"
    EXPECTED_ATTENTION = "expected_attention"
    OBSERVED_ATTENTION = "observed_attention"
    KVZIP = "kvzip"
    QUEST = "quest"
    ECHO = "echo"
    HOST_TIER = "host_tier"
    SWAP = "swap"
    AUTO_PREEMPTION = "auto_preemption"
    MESH = "mesh"
    SNAPSHOT = "snapshot"
    N_SAMPLES = "n_samples"
    PREFIX_CACHE = "prefix_cache"
    CONTIGUOUS = "contiguous"
    SPECULATIVE = "speculative"
    CONTEXT_REUSE = "context_reuse"
    KV_ARENA = "kv_arena"
    PAUSE = "pause"
    CONTROLLER = "controller"
    BATCH_INVARIANT = "batch_invariant"
    HOST_ROWS = "host_rows"
    FUSED_KV_WRITE = "fused_kv_write"
    PYRAMID = "pyramid"
    RECORD_DECISIONS = "record_decisions"
    DISAGGREGATION = "disaggregation"
    ADAKV = "adakv"
    PYRAMID_ADAKV = "pyramid_adakv"
    PER_HEAD = "per_head"
    GLOBAL = "global"
    MIXED_PRECISION = "mixed_precision"

    @property
    def group(self) -> str | None:
        return _GROUPS.get(self)

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_GROUPS = {
    Feature.INT8: "codec", Feature.KIVI: "codec", Feature.KIVI_RESIDUAL: "codec",
    Feature.LOWRANK: "codec",
    Feature.MIXED_PRECISION: "codec",
    Feature.STREAMING: "retention", Feature.STREAMING_ROTATED: "retention",
    Feature.H2O: "retention", Feature.SNAPKV: "retention", Feature.QUEST: "retention",
    Feature.ECHO: "retention",
    Feature.TOVA: "retention", Feature.KNORM: "retention",
    Feature.EXPECTED_ATTENTION: "retention", Feature.OBSERVED_ATTENTION: "retention",
    Feature.KVZIP: "retention",
    Feature.SWAP: "preemption", Feature.AUTO_PREEMPTION: "preemption",
    Feature.PYRAMID: "retention_schedule", Feature.ADAKV: "retention_schedule",
    Feature.PYRAMID_ADAKV: "retention_schedule", Feature.PER_HEAD: "retention_schedule",
    Feature.GLOBAL: "retention_schedule",
}
_DESCRIPTIONS = {
    Feature.INT8: "kv_codec int8, or another codec that stores codes and scales in the pages "
                  "(int4, int2, fp8)",
    Feature.KIVI: "kv_codec kivi4 or kivi2 with residual=0 (a window of fewer than `group` "
                  "exact tokens per sequence)",
    Feature.KIVI_RESIDUAL: "kv_codec kivi4 or kivi2 with residual > 0 (the most recent "
                           "`residual` tokens stay exact)",
    Feature.LOWRANK: "kv_codec lowrank: keys stored as their coordinates in a calibrated "
                     "rank-r basis per layer and kv head (float32 or int8), read by attention "
                     "in that form; values exact",
    Feature.STREAMING: "retention='streaming' (attention sinks and a recent window)",
    Feature.STREAMING_ROTATED: "retention='streaming' with cache_positions=True and "
                               "num_sinks > 0 (each eviction re-rotates the sinks' keys)",
    Feature.H2O: "retention='h2o' (heavy hitters by accumulated attention)",
    Feature.SNAPKV: "retention='snapkv' (compresses the prompt once from its last queries)",
    Feature.TOVA: "retention='tova' (evicts the tokens the newest query attends to least)",
    Feature.KNORM: "retention='knorm' (compresses the prompt once to its lowest key norms)",
    Feature.EXPECTED_ATTENTION: "retention='expected_attention' (compresses the prompt once "
                                "by the attention expected from future queries)",
    Feature.OBSERVED_ATTENTION: "retention='observed_attention' (compresses the prompt once "
                                "by its mean attention during prefill)",
    Feature.KVZIP: "retention='kvzip' (compresses the prompt once by the attention of probe "
                   "rows that repeat it, run after its prefill)",
    Feature.QUEST: "retention='quest' (keeps every page, reads the query's top pages)",
    Feature.ECHO: "retention='quest' with echo_prefetch (ECHO: the host pool holds every "
                  "full page, the device per layer the pages that layer's last selection "
                  "ranked first; a selected page not on the device is read from the host)",
    Feature.HOST_TIER: "EngineConfig.tiers with a host budget (spills and swaps through it)",
    Feature.SWAP: "preemption_mode=SWAP",
    Feature.AUTO_PREEMPTION: "preemption_mode=AUTO (swap or recompute by a cost model)",
    Feature.MESH: "a tensor-parallel mesh (Engine(..., mesh=...))",
    Feature.SNAPSHOT: "kvjax.engine.snapshot: save in-flight requests, restore them mid-run",
    Feature.N_SAMPLES: "SamplingParams(n > 1): samples fork after a shared prompt",
    Feature.PREFIX_CACHE: "enable_prefix_cache=True",
    Feature.CONTIGUOUS: "kv_layout=CONTIGUOUS (a max_model_len slot per sequence)",
    Feature.SPECULATIVE: "EngineConfig.spec with a draft method (ngram, sparse_self): "
                         "drafts verified against the KV plain decoding would read, rejected "
                         "ones rolled back",
    Feature.CONTEXT_REUSE: "EngineConfig.context_reuse with a strategy that reuses cached "
                           "chunks (none, ape, epic, cacheblend): non-prefix KV reuse",
    Feature.PAUSE: "Engine.pause / resume: requests leave scheduling mid-run, their pages kept "
                   "or swapped to host, and go on later",
    Feature.KV_ARENA: "kv_arena=True: pages are frames of a word arena, the layout models "
                      "of a MultiModelEngine share one budget through",
    Feature.CONTROLLER: "EngineConfig.controller (e.g. 'joint') serving the requests' SLOs: "
                        "it orders admission, preempts (swap, recompute, int8 host copies) "
                        "and sets per-sequence retention budgets",
    Feature.BATCH_INVARIANT: "batch_invariant=True: a sequence's logprobs bitwise the same "
                             "whatever the batch, and the same as the RL trainer's forward",
    Feature.HOST_ROWS: "host_split other than 'never' with num_host_pages > 0: decode rows "
                       "keep older pages in a host pool, where their attention reads them, "
                       "merged exactly with the device's part",
    Feature.FUSED_KV_WRITE: "fused_kv_write=True: each layer's K/V projection writes its "
                            "rows into the pages itself (the native CPU kernel, or the "
                            "Pallas kernel beside the Pallas attention)",
    Feature.PYRAMID: "retention_schedule='pyramid' (PyramidKV: the budget of a press that "
                     "compresses the prompt once shared over layers, each run of equal "
                     "budgets in a block table of its own that gives back the pages past "
                     "its budget)",
    Feature.RECORD_DECISIONS: "Engine.record_decisions: the scheduler's calls and decisions "
                              "recorded, for kvjax.scheduler.replay to decide again without "
                              "a model",
    Feature.DISAGGREGATION: "prefill/decode disaggregation (DisaggregatedEngine, the "
                            "server's P/D endpoints, RL page migration): a prompt's full "
                            "pages move from one engine's prefix cache into another's",
    Feature.ADAKV: "retention_schedule='adakv' (AdaKV: each layer's budget of a press that "
                   "compresses the prompt once split over its kv heads by their scores, in "
                   "head-major pages with a block table per (layer, kv head) that gives back "
                   "each head's pages past its share)",
    Feature.PYRAMID_ADAKV: "retention_schedule='pyramid_adakv' (PyramidKV's per-layer "
                           "budgets, each layer's split over its kv heads as AdaKV splits "
                           "it, in the same head-major pages)",
    Feature.PER_HEAD: "retention_schedule='per_head' (kvpress's granularity: every layer and kv "
                      "head keeps the budget of a press that compresses the prompt once, by "
                      "its own scores, in AdaKV's head-major pages and tables)",
    Feature.GLOBAL: "retention_schedule='global' (KVzip's default: the (layer, kv head, token) "
                    "pairs of largest score of a press that compresses the prompt once, "
                    "every layer's heads ranked together, in AdaKV's head-major pages and "
                    "tables)",
    Feature.MIXED_PRECISION: "kv_codec='mixed' (DiffKV): each token row's key and value at a "
                             "class of its own (exact, int8, int4), new rows at the write "
                             "class; a controller re-encodes running sequences' cold pages in "
                             "place, and the bytes they free go to new pages",
}

_KIVI = (Feature.KIVI, Feature.KIVI_RESIDUAL)
_CODECS = (Feature.INT8, *_KIVI)
_EVICTING = (Feature.STREAMING, Feature.STREAMING_ROTATED, Feature.H2O, Feature.SNAPKV,
             Feature.TOVA, Feature.KNORM, Feature.EXPECTED_ATTENTION,
             Feature.OBSERVED_ATTENTION, Feature.KVZIP)
_QUEST = (Feature.QUEST, Feature.ECHO)
_RETENTION = (*_EVICTING, *_QUEST)
_HEAD_SPLITS = (Feature.ADAKV, Feature.PYRAMID_ADAKV, Feature.PER_HEAD, Feature.GLOBAL)
_SCHEDULES = (Feature.PYRAMID, *_HEAD_SPLITS)


def _refusals() -> dict[frozenset[Feature], str]:
    table: dict[frozenset[Feature], str] = {}

    def refuse(firsts: Iterable[Feature], seconds: Iterable[Feature], reason: str) -> None:
        for a, b in itertools.product(firsts, seconds):
            table[frozenset((a, b))] = reason

    refuse(_CODECS, [Feature.CONTIGUOUS],
           "quantized codes and scales are stored per page, so a kv_codec needs the paged "
           "layout")
    refuse([*_RETENTION, *_SCHEDULES], [Feature.CONTIGUOUS],
           "retention frees and selects whole pages, so it needs the paged layout")
    refuse([Feature.HOST_TIER], [Feature.CONTIGUOUS],
           "tiers move whole pages, so they need the paged layout")
    refuse(_QUEST, [Feature.SPECULATIVE],
           "Quest picks the pages each decode query reads from that query alone and from "
           "per-page key bounds, while a verify step attends a row's queries over one set of "
           "pages and its rejected drafts' keys would stay in the bounds, so drafts would be "
           "checked against other attention than plain decoding's")
    refuse(_KIVI, [Feature.CONTEXT_REUSE],
           "KIVI quantizes keys in groups along a sequence's own tokens beside an exact "
           "window, so a chunk's keys cannot be re-rotated and placed token by token into "
           "another sequence's groups")
    refuse([*_EVICTING, *_SCHEDULES], [Feature.CONTEXT_REUSE],
           "an evicting policy keeps the tokens a sequence's own attention chose, so a chunk "
           "computed alone would be cut to what it attended to, not to what the request that "
           "reuses it would keep")
    refuse([Feature.CONTIGUOUS], [Feature.CONTEXT_REUSE],
           "the chunk cache keeps chunks as shared prefix-cache pages, which the contiguous "
           "layout does not have")
    refuse(_KIVI, [Feature.KV_ARENA],
           "KIVI stores keys per channel group across a sequence's tokens, while an arena "
           "frame, shared by models of any shape, stores each token's row on its own")
    refuse(_QUEST, [Feature.KV_ARENA],
           "Quest keeps per-page key summaries in arrays of one model's shape beside the "
           "pages, which frames that pass between models of other shapes cannot carry")
    refuse([Feature.CONTIGUOUS], [Feature.KV_ARENA],
           "an arena hands out frames as pages on demand, which the contiguous layout's "
           "reserved slots are not")
    refuse([Feature.MESH], [Feature.KV_ARENA],
           "an arena frame packs every kv head of a token into one row of words, so there is "
           "no kv-head axis for a mesh to shard")
    refuse(_CODECS, [Feature.BATCH_INVARIANT],
           "a quantized cache holds other K/V than the trainer's forward computes, so rollout "
           "logprobs could not equal the trainer's bit for bit")
    refuse([*_RETENTION, *_SCHEDULES], [Feature.BATCH_INVARIANT],
           "retention drops or skips tokens that the trainer's full forward attends to, so "
           "rollout logprobs could not equal the trainer's")
    refuse([Feature.CONTIGUOUS], [Feature.BATCH_INVARIANT],
           "the invariant attention reads each query's pages in place in a fixed order, and "
           "the contiguous layout has no pages")
    refuse([Feature.MESH], [Feature.BATCH_INVARIANT],
           "a mesh splits each matmul's sum over devices and adds the parts in an order the "
           "mesh sets, not the fixed order the mode promises")
    refuse([Feature.SPECULATIVE], [Feature.BATCH_INVARIANT],
           "a verify step accepts drafts by probability ratios whose softmax sums follow the "
           "verify batch's shape, so the tokens a sequence keeps would follow the batch")
    refuse([Feature.CONTEXT_REUSE], [Feature.BATCH_INVARIANT],
           "a reused chunk's K/V were computed without the tokens before it, so a sequence's "
           "logprobs would follow which chunks other requests left cached")
    refuse([Feature.KV_ARENA], [Feature.BATCH_INVARIANT],
           "arena frames store each token as words of the model's codec, not the float32 "
           "pages the invariant attention reads in place")
    refuse([Feature.CONTROLLER], [Feature.BATCH_INVARIANT],
           "the controller degrades KV under load (int8 host copies, retention budgets), so a "
           "sequence's logprobs would follow the load")
    refuse(_KIVI, [Feature.HOST_ROWS],
           "KIVI's row reader joins a sequence's quantized pages with its exact window by "
           "length, while a host-resident row splits its positions between two pools")
    refuse([*_RETENTION, *_SCHEDULES], [Feature.HOST_ROWS],
           "retention compacts, evicts or selects a row's pages in the device pool, while "
           "host-resident pages are read whole and never rewritten")
    refuse([Feature.SPECULATIVE], [Feature.HOST_ROWS],
           "a verify step's decode rows attend several queries through the prefill path, "
           "while host-resident rows are one-query decode rows")
    refuse([Feature.CONTIGUOUS], [Feature.HOST_ROWS],
           "the contiguous layout has no pages to move to a host pool")
    refuse([Feature.MESH], [Feature.HOST_ROWS],
           "the host pool and its attention are built for one device's pool, not for a "
           "mesh's kv heads sharded over devices")
    refuse([Feature.KV_ARENA], [Feature.HOST_ROWS],
           "arena frames are words shared between models, which a host pool of one model's "
           "page format does not mirror")
    refuse([Feature.BATCH_INVARIANT], [Feature.HOST_ROWS],
           "splitting a row's attention between two pools changes the order its sums are "
           "added in, so its logprobs would follow the split")
    refuse([Feature.HOST_TIER], [Feature.HOST_ROWS],
           "the tiers' checked swaps copy a sequence's pages from its first one, while a "
           "host-resident row's first pages are already in the host pool")
    refuse([Feature.SNAPSHOT], [Feature.HOST_ROWS],
           "a snapshot saves a sequence's pages through its device block table, whose "
           "host-resident entries hold no page")
    refuse(_CODECS, [Feature.FUSED_KV_WRITE],
           "a quantized pool stores codes and scales made from a whole group of values, while "
           "the fused write stores each projected float32 row as it comes out of the matmul")
    refuse(_QUEST, [Feature.FUSED_KV_WRITE],
           "Quest updates each written page's key summaries from the new keys, which the "
           "fused write stores straight into the pages without handing them back")
    refuse([Feature.CONTIGUOUS], [Feature.FUSED_KV_WRITE],
           "the fused write stores rows into a pool of pages, and the contiguous layout has "
           "no pages")
    refuse([Feature.KV_ARENA], [Feature.FUSED_KV_WRITE],
           "arena frames store each token as words of the model's codec, not the float32 "
           "rows the fused write stores")
    refuse([Feature.MESH], [Feature.FUSED_KV_WRITE],
           "the fused write is one kernel over the whole pool, which a mesh shards by kv "
           "head over devices")
    refuse(_KIVI, [Feature.ECHO],
           "KIVI's row reader joins a sequence's quantized pages with its exact window in the "
           "device pool's sequence slot, which the host pool's copies of full pages do not "
           "carry")
    refuse([Feature.MESH], [Feature.ECHO],
           "the host pool and its reads are built for one device's pool, not for a mesh's kv "
           "heads sharded over devices")
    refuse([Feature.SNAPSHOT], [Feature.ECHO],
           "a snapshot saves a sequence's pages through its device block table, whose "
           "released entries hold no page")
    refuse([Feature.HOST_TIER], [Feature.ECHO],
           "the tiers' checked swaps copy a sequence's pages through its device block table, "
           "whose released entries hold no page")
    refuse([Feature.CONTROLLER], [Feature.ECHO],
           "the controller prices swaps, recomputes and demotions with a model of the device "
           "pool that does not count pages whose only copy is in the host pool")
    refuse([Feature.STREAMING_ROTATED, Feature.EXPECTED_ATTENTION], [Feature.RECORD_DECISIONS],
           "this policy's host record uses the model's RoPE (to rotate kept keys or to score "
           "them), and a replay rebuilds the record without a model")
    refuse([Feature.KVZIP], [Feature.RECORD_DECISIONS],
           "kvzip's probe rows are its instructions encoded by the model's tokenizer, and a "
           "replay rebuilds the scheduler without a model")
    refuse([Feature.KVZIP], _KIVI,
           "a probe row writes its tokens after the context and gives them back once scored, "
           "while KIVI would quantize key groups and move its exact window over them")
    refuse([Feature.KVZIP], [Feature.SNAPSHOT],
           "a snapshot saves a sequence's pages and retention record but not the probe rows "
           "it has still to run, so a restored sequence would decode without its compaction")
    refuse([Feature.SNAPSHOT], [Feature.RECORD_DECISIONS],
           "a restore puts requests and their pages back outside the scheduler's recorded "
           "calls, so a replay would decide without them")
    refuse([Feature.DISAGGREGATION], [Feature.RECORD_DECISIONS],
           "an import commits pages to the prefix cache outside the scheduler's recorded "
           "calls, so a replay would find other prefix hits than the run did")
    refuse([Feature.ECHO, Feature.HOST_ROWS], [Feature.RECORD_DECISIONS],
           "a replay rebuilds the scheduler without the host pool that host-resident rows and "
           "ECHO's selections move pages to, so it cannot place them")
    refuse(_KIVI, [Feature.DISAGGREGATION],
           "KIVI keeps each sequence's latest tokens exact in a window slot of its own, which "
           "a transfer of full pages neither carries nor has a sequence to hold")
    refuse([Feature.CONTEXT_REUSE], [Feature.DISAGGREGATION],
           "a reused chunk's pages are keyed by the chunk alone, not by the prompt's prefix "
           "chain, along which the pair moves a prompt's pages to the decode engine")
    refuse([Feature.SNAPSHOT], [Feature.DISAGGREGATION],
           "a snapshot saves one engine's requests, while a disaggregated request also lives "
           "in the pair's handoffs and the pages its import pins, which it does not hold")
    refuse([Feature.N_SAMPLES], [Feature.DISAGGREGATION],
           "the prefill engine hands the decode engine one sequence, its pages and its first "
           "token, while n > 1 samples each draw their own first token from the prompt")
    refuse([Feature.CONTIGUOUS], [Feature.DISAGGREGATION],
           "pages move from one engine's prefix cache into another's, so both need the paged "
           "layout, and the contiguous one has neither pages nor a prefix cache")
    for features, reason in _LOWRANK_REFUSED:
        refuse([Feature.LOWRANK], features, reason)
    for features, reason in _PYRAMID_REFUSED:
        refuse([Feature.PYRAMID], features, reason)
    # AdaKV's split, per-layer budgets split over heads, the even split and the global one:
    # the same head-major pages and tables, so the same refusals (each reason names the
    # per-head split, which every one of them runs).
    for features, reason in _ADAKV_REFUSED:
        refuse(list(_HEAD_SPLITS), features, reason)
    _refuse_mixed(refuse)
    return table


# The low-rank key pool's refusals: it holds each key as coordinates in a basis of the
# post-RoPE keys, which a rotation does not preserve, and attention reads them with queries
# projected alike (`kvjax.kv.lowrank`).
_LOWRANK_REFUSED = (
    ((Feature.CONTIGUOUS,),
     "the key coordinates are stored per page, so the low-rank pool needs the paged layout"),
    ((*_RETENTION, *_SCHEDULES),
     "retention scores cached tokens against whole keys and re-rotates kept keys, while the "
     "low-rank pool keeps only each key's coordinates in a basis that a rotation leaves"),
    ((Feature.CONTEXT_REUSE,),
     "a reused chunk's keys are turned to their new positions, and a turned key leaves the "
     "calibrated basis its coordinates are stored in"),
    ((Feature.KV_ARENA,),
     "an arena frame stores every model's tokens as K and V rows of its head dim, not key "
     "coordinates read through a basis the frame does not carry"),
    ((Feature.BATCH_INVARIANT,),
     "projected keys are other K than the trainer's forward computes, so rollout logprobs "
     "could not equal the trainer's"),
    ((Feature.HOST_ROWS,),
     "a host-resident row's attention reads whole keys from the host pool's pages, which "
     "hold no basis to project its queries by"),
    ((Feature.FUSED_KV_WRITE,),
     "the fused write stores each key row as it leaves the matmul, not its coordinates in "
     "the calibrated basis"),
)


# The budget schedules' refusals: under PyramidKV each table group, under AdaKV each (layer,
# kv head) table in head-major pages, holds its own tokens at its own cached length
# (`kvjax.kv.layer_retention`, `kvjax.kv.head_retention`). They run with an evicting press, so
# where every press is refused (the contiguous layout, context reuse, batch invariance,
# host-resident rows) they are refused beside them, for the same reason, in `_refusals`.
_ADAKV_REFUSED = (
    ((Feature.STREAMING, Feature.STREAMING_ROTATED, Feature.H2O, Feature.TOVA),
     "this policy evicts as a sequence decodes, while the per-head split shares a layer's "
     "budget once, over the prompt's scores when its prefill completes"),
    (_QUEST,
     "Quest keeps every page and narrows what each query reads, so it has no budget of kept "
     "tokens to split over heads"),
    (_KIVI,
     "KIVI's exact window and key groups follow one cached length per sequence, while the "
     "per-head split's (layer, kv head) tables each hold a different number of tokens"),
    ((Feature.HOST_TIER,),
     "the host and disk tiers move and index one block table of pages per sequence, while "
     "the per-head split keeps one per (layer, kv head) table"),
    ((Feature.SPECULATIVE,),
     "a verify step scores each draft query's keys summed over every layer and head, while "
     "the per-head split ranks each head by its own scores"),
    ((Feature.KV_ARENA,),
     "an arena frame holds every kv head of a token, so heads cannot give back pages apart"),
    ((Feature.MESH,),
     "a mesh shards each page's kv-head axis over devices, while a head-major page holds "
     "one kv head"),
    ((Feature.CONTROLLER,),
     "the controller sets one token budget per sequence, priced by KL measured with every "
     "head keeping the same tokens"),
    ((Feature.FUSED_KV_WRITE,),
     "the fused write stores a token's every kv head into one page row, while a head-major "
     "page holds one kv head"),
    ((Feature.RECORD_DECISIONS,),
     "a replay rebuilds one retention record per sequence, while the per-head split keeps "
     "one per (layer, kv head) table"),
    ((Feature.DISAGGREGATION,),
     "the pair moves a prompt's pages with every kv head of a token in one page, while the "
     "per-head split keeps head-major pages that each head gives back apart"),
)


def _refuse_mixed(refuse) -> None:
    """A mixed-precision pool's refusals (`kvjax.kv.mixed`, `kvjax.memory.precision`): its rows
    are words at each row's class, and a host ledger counts each page's bytes at one class."""
    for features, reason in _MIXED_REFUSED:
        refuse([Feature.MIXED_PRECISION], features, reason)


_MIXED_REFUSED = (
    ((Feature.MESH,),
     "a mixed-precision row packs every kv head of a token into one row of words, so there is "
     "no kv-head axis for a mesh to shard"),
    ((Feature.STREAMING_ROTATED,),
     "re-rotating the sinks' keys rewrites cached keys as float rows, while a mixed-precision "
     "pool holds each key as words at its row's class, which a demoted row cannot regain"),
    ((Feature.STREAMING, Feature.H2O, Feature.SNAPKV, Feature.TOVA, Feature.KNORM,
      Feature.EXPECTED_ATTENTION, Feature.OBSERVED_ATTENTION, Feature.KVZIP, *_SCHEDULES),
     "retention compacts kept rows across pages, while the precision ledger counts each "
     "page's bytes at one class, so a page refilled with rows of another class would be "
     "counted at the wrong one"),
    ((Feature.CONTEXT_REUSE,),
     "a reused chunk's keys are re-rotated and scaled as float rows when copied in, while a "
     "mixed-precision pool holds rows as words at their own class, and a demoted chunk page "
     "would serve later requests as exact"),
    ((Feature.KV_ARENA,),
     "an arena frame stores every token at the one codec the models sharing it agree on, "
     "while a mixed-precision pool gives each row a class of its own"),
    ((Feature.CONTIGUOUS,),
     "the precision ledger counts bytes per page and lends what demoted pages free to new "
     "pages, which the contiguous layout's reserved per-sequence slots cannot take"),
    ((Feature.BATCH_INVARIANT,),
     "a controller demotes rows under load and the invariant attention reads float32 pages "
     "in place, so a sequence's logprobs could not equal the trainer's bit for bit"),
    ((Feature.FUSED_KV_WRITE,),
     "the fused write stores each projected float32 row straight into float pages, while a "
     "mixed-precision pool stores words at each row's class"),
)


_PYRAMID_REFUSED = (
    ((Feature.STREAMING, Feature.STREAMING_ROTATED, Feature.H2O, Feature.TOVA),
     "this policy evicts as a sequence decodes, while the per-layer schedule shares a budget "
     "once, over the prompt's scores when its prefill completes"),
    (_QUEST,
     "Quest keeps every page and narrows what each query reads, so it has no budget of kept "
     "tokens to share over layers"),
    (_KIVI,
     "KIVI's exact window and key groups follow one cached length per sequence, while the "
     "per-layer schedule's table groups each hold a different number of tokens"),
    ((Feature.HOST_TIER,),
     "the host and disk tiers move and index one block table of pages per sequence, while "
     "the per-layer schedule keeps one per table group"),
    ((Feature.SPECULATIVE,),
     "a verify step scores each draft query's keys summed over every layer, while the "
     "per-layer schedule ranks each table group by its own layers' scores"),
    ((Feature.KV_ARENA,),
     "an arena frame holds every layer of a token, so layers cannot give back pages apart"),
    ((Feature.MESH,),
     "the mesh's sharded programs are built for the model's own layer groups, not a pool "
     "regrouped by retention budget"),
    ((Feature.CONTROLLER,),
     "the controller sets one token budget per sequence, priced by KL measured with every "
     "layer keeping the same tokens"),
    ((Feature.RECORD_DECISIONS,),
     "a replay rebuilds one retention record per sequence, while the per-layer schedule "
     "keeps one per table group"),
)


REFUSED: dict[frozenset[Feature], str] = _refusals()
"""Every pair of features that does not compose, with the reason. Pairs not listed work."""


class ModelTrait(enum.Enum):
    """A property of a model's architecture that some features cannot serve."""

    POSITION_DEPENDENT_ROPE = "position_dependent_rope"
    LAYER_GROUPS = "layer_groups"
    PER_LAYER_ROPE = "per_layer_rope"
    MLA_LATENT = "mla_latent"
    QK_NORM = "qk_norm"
    MOE = "moe"

    @property
    def description(self) -> str:
        return _TRAIT_DESCRIPTIONS[self]


_TRAIT_DESCRIPTIONS = {
    ModelTrait.POSITION_DEPENDENT_ROPE: "RoPE whose frequencies depend on the position "
                                        "(rope_type dynamic or longrope, e.g. Phi-3 128k)",
    ModelTrait.LAYER_GROUPS: "sliding-window layers (`ModelConfig.layer_windows`: Mistral, "
                             "Qwen2/Qwen3 with windows, Gemma): KV layer groups with block "
                             "tables of their own",
    ModelTrait.PER_LAYER_ROPE: "layers turned by RoPEs of different bases (ModelConfig."
                               "local_rope, e.g. Gemma 3's local and global layers)",
    ModelTrait.MLA_LATENT: "multi-head latent attention (ModelConfig.mla, DeepSeek-V2/V3): "
                           "one latent row per token and layer in place of K and V heads",
    ModelTrait.QK_NORM: "per-head RMSNorm of queries and keys before RoPE (ModelConfig."
                        "qk_norm: Qwen3, Gemma 3)",
    ModelTrait.MOE: "a mixture-of-experts MLP (ModelConfig.moe: Mixtral, Qwen2/Qwen3-MoE, "
                    "DeepSeek-V2/V3)",
}
_LATENT_CODEC = ("a KV codec quantizes K and V heads token by token, while an MLA page holds "
                 "one latent row per token that is the key and, in its first kv_lora_rank "
                 "columns, the value of every head, which no codec here stores")
_LATENT_ROTATION = ("{} turns every column of a cached key by RoPE, while an MLA latent row "
                    "carries RoPE only in its last qk_rope_head_dim columns")
_ONE_TABLE = ("{} one block table of pages per sequence, while a model with sliding-window "
              "layers keeps one per layer group, its windows' older pages already given back")
_SHIFTED_KEYS = ("{} choose a key's frequencies by its position, so a key turned by a shift "
                 "is not the key at its new position")
MODEL_REFUSED: dict[tuple[ModelTrait, Feature], str] = {
    (ModelTrait.POSITION_DEPENDENT_ROPE, Feature.CONTEXT_REUSE): _SHIFTED_KEYS.format(
        "dynamic NTK and LongRoPE") + ", which is what a reused chunk's keys need",
    (ModelTrait.POSITION_DEPENDENT_ROPE, Feature.STREAMING_ROTATED): _SHIFTED_KEYS.format(
        "dynamic NTK and LongRoPE") + ", which is what rotated attention sinks need",
    (ModelTrait.POSITION_DEPENDENT_ROPE, Feature.EXPECTED_ATTENTION): (
        "dynamic NTK and LongRoPE choose a query's frequencies by its position, so the "
        "prompt's queries cannot be turned back by a shift to one Gaussian, nor forward to "
        "the future positions ExpectedAttention averages over"),
    **{(ModelTrait.LAYER_GROUPS, f): _ONE_TABLE.format(what) for f, what in (
        (Feature.KIVI, "KIVI's key groups and exact windows follow"),
        (Feature.KIVI_RESIDUAL, "KIVI's key groups and exact windows follow"),
        (Feature.STREAMING, "a retention policy compacts"),
        (Feature.STREAMING_ROTATED, "a retention policy compacts"),
        (Feature.H2O, "a retention policy compacts"),
        (Feature.SNAPKV, "a retention policy compacts"),
        (Feature.TOVA, "a retention policy compacts"),
        (Feature.KNORM, "a retention policy compacts"),
        (Feature.EXPECTED_ATTENTION, "a retention policy compacts"),
        (Feature.OBSERVED_ATTENTION, "a retention policy compacts"),
        (Feature.KVZIP, "a retention policy compacts"),
        (Feature.QUEST, "Quest's page summaries and selections index"),
        (Feature.ECHO, "ECHO's residency and host-pool reads index"),
        (Feature.HOST_TIER, "the host and disk tiers move and index"),
        (Feature.CONTEXT_REUSE, "a reused chunk is copied in through"),
        (Feature.KV_ARENA, "an arena frame holds every layer of"),
        (Feature.CONTROLLER, "the controller's swaps and demotions move"),
        (Feature.CONTIGUOUS, "contiguous slots preallocate every layer of"),
        (Feature.MESH, "the mesh's sharded programs are built for"),
        (Feature.HOST_ROWS, "the host pool's moves and split attention follow"),
        (Feature.MIXED_PRECISION, "the precision ledger counts the pages of"))},
    (ModelTrait.LAYER_GROUPS, Feature.PYRAMID):
        "the per-layer schedule regroups layers into block tables of equal retention budget, "
        "while a model with sliding-window layers already keeps one per window group",
    **{(ModelTrait.LAYER_GROUPS, f):
       "the per-head split keeps a block table per layer and kv head, while a model with "
       "sliding-window layers already keeps one per window group"
       for f in _HEAD_SPLITS},
    **{(ModelTrait.MLA_LATENT, f):
       "an MLA latent row is one head that every query head reads, so there are no kv heads "
       "to split a budget over" for f in _HEAD_SPLITS},
    (ModelTrait.PER_LAYER_ROPE, Feature.CONTEXT_REUSE):
        "a reused chunk's keys are re-rotated by one RoPE for every layer, while this model "
        "turns the keys of its local layers by another",
    (ModelTrait.PER_LAYER_ROPE, Feature.STREAMING_ROTATED):
        "rotated attention sinks turn kept keys by one RoPE for every layer, while this model "
        "turns the keys of its local layers by another",
    **{(ModelTrait.MLA_LATENT, f): _LATENT_CODEC for f in (*_CODECS, Feature.LOWRANK,
                                                              Feature.MIXED_PRECISION)},
    (ModelTrait.LAYER_GROUPS, Feature.LOWRANK):
        "the low-rank pool's key bases are calibrated per model layer, while a pool of several "
        "layer groups indexes layers within a group's page",
    (ModelTrait.MLA_LATENT, Feature.STREAMING_ROTATED): _LATENT_ROTATION.format(
        "re-rotating attention sinks"),
    (ModelTrait.MLA_LATENT, Feature.CONTEXT_REUSE): _LATENT_ROTATION.format(
        "re-rotating a reused chunk"),
    (ModelTrait.MLA_LATENT, Feature.EXPECTED_ATTENTION): (
        "ExpectedAttention turns its query statistics by RoPE across every column, while an "
        "MLA query meets the latent in columns RoPE does not turn and only its last "
        "qk_rope_head_dim columns rotate"),
    (ModelTrait.MLA_LATENT, Feature.KNORM): (
        "KNorm ranks tokens by the norm of their key, and an MLA latent row is no head's "
        "key: each head's key is the latent through that head's own up-projection beside "
        "the RoPE part"),
    (ModelTrait.MLA_LATENT, Feature.MESH):
        "a mesh shards the kv-head axis, while an MLA cache has one latent head that every "
        "query head reads",
    (ModelTrait.MLA_LATENT, Feature.KV_ARENA):
        "an arena frame holds a token's K and V heads as words of the model's codec, not an "
        "MLA latent row",
    (ModelTrait.MLA_LATENT, Feature.CONTIGUOUS):
        "contiguous slots hold separate K and V tensors, which an MLA latent row (the key and "
        "the value at once) would fill twice",
    (ModelTrait.MLA_LATENT, Feature.BATCH_INVARIANT):
        "the batch-invariant attention is the native CPU kernel, which reads K and V pages of "
        "their own, not MLA latent pages",
    (ModelTrait.MLA_LATENT, Feature.FUSED_KV_WRITE):
        "the fused write projects K and V heads into pages of their own, while an MLA cache "
        "holds one latent row per token made by other projections",
    (ModelTrait.MOE, Feature.BATCH_INVARIANT):
        "whether each token's chosen experts run alone, grouped with other tokens' rows by "
        "expert, or every expert runs on every token (each summed in its own order) depends "
        "on the step's token count, so a sequence's logits change with the batch it shares",
}
"""Every feature a model trait refuses, with the reason."""


def model_traits(model_config: Any) -> set[ModelTrait]:
    """The traits of a `ModelConfig` that `MODEL_REFUSED` knows."""
    traits = set() if model_config.rope.is_shift_invariant else {
        ModelTrait.POSITION_DEPENDENT_ROPE}
    if any(model_config.layer_windows):
        traits.add(ModelTrait.LAYER_GROUPS)
    if model_config.local_rope is not None:
        traits.add(ModelTrait.PER_LAYER_ROPE)
    if model_config.mla is not None:
        traits.add(ModelTrait.MLA_LATENT)
    if model_config.qk_norm:
        traits.add(ModelTrait.QK_NORM)
    if model_config.moe is not None:
        traits.add(ModelTrait.MOE)
    return traits


def check_model(config: Any, model_config: Any, *, on_mesh: bool = False,
                uses: Iterable[Feature] = ()) -> None:
    """Raises ValueError when a feature of `config` (an `EngineConfig`), or one it is about to
    be `uses`d for (snapshots), does not serve a model of `model_config`, naming the setting,
    the model and the reason from `MODEL_REFUSED`."""
    traits = model_traits(model_config)
    used = [_Present(f, _USE_SETTINGS[f]) for f in uses]
    for present in _present(config, on_mesh) + used:
        for trait in traits:
            reason = MODEL_REFUSED.get((trait, present.feature))
            if reason is not None:
                raise ValueError(f"{present.setting} does not serve model {model_config.name!r} "
                                 f"({trait.value}): {reason}")


def pairs() -> list[tuple[Feature, Feature]]:
    """Every pair of features that can meet (not of one group), in the enum's order."""
    return [(a, b) for a, b in itertools.combinations(Feature, 2)
            if a.group is None or a.group != b.group]


def refusal(a: Feature, b: Feature) -> str | None:
    """Why `a` and `b` do not compose, or None when they do."""
    return REFUSED.get(frozenset((a, b)))


@dataclasses.dataclass(frozen=True)
class _Present:
    feature: Feature
    setting: str  # how the config names it, for the error message


def _codec(config: Any) -> list[_Present]:
    if config.kv_codec == "none":
        return []
    if config.kv_codec == MIXED_CODEC:
        MixedOptions.parse(config.kv_codec_options)
        return [_Present(Feature.MIXED_PRECISION, "kv_codec='mixed'")]
    codec = quantized.make_codec(config.kv_codec, **config.kv_codec_options)  # checks options
    if config.kv_codec == Feature.LOWRANK.value:
        return [_Present(Feature.LOWRANK, f"kv_codec={config.kv_codec!r}")]
    if not quantized.is_kivi(codec):
        return [_Present(Feature.INT8, f"kv_codec={config.kv_codec!r}")]
    if codec.residual:
        return [_Present(Feature.KIVI_RESIDUAL,
                         f"kv_codec={config.kv_codec!r} with residual={codec.residual!r}")]
    return [_Present(Feature.KIVI, f"kv_codec={config.kv_codec!r}")]


def _retention(config: Any) -> list[_Present]:
    policy = make_retention(config.retention, config.retention_budget, config.page_size,
                            **config.retention_options)
    if policy.name == "none":
        return []
    if policy.rotates_keys:
        return [_Present(Feature.STREAMING_ROTATED, f"retention={config.retention!r} with "
                         f"retention_options={config.retention_options!r}")]
    if policy.echo_prefetch is not None:
        return [_Present(Feature.ECHO, f"retention={config.retention!r} with echo_prefetch="
                         f"{policy.echo_prefetch!r}")]
    feature = next((f for f in _RETENTION if f.value == policy.name), None)
    if feature is None:  # A registered policy of its own: the built-in one that acts alike.
        feature = Feature.STREAMING if policy.evicts else Feature.QUEST
    return [_Present(feature, f"retention={config.retention!r}")]


def _present(config: Any, on_mesh: bool) -> list[_Present]:
    found = _codec(config) + _retention(config)
    if config.tiers.enabled:
        found.append(_Present(Feature.HOST_TIER,
                              f"tiers (host_bytes={config.tiers.host_bytes})"))
    mode = PreemptionMode(config.preemption_mode)
    if mode is PreemptionMode.SWAP:
        found.append(_Present(Feature.SWAP, "preemption_mode='swap'"))
    elif mode is PreemptionMode.AUTO:
        found.append(_Present(Feature.AUTO_PREEMPTION, "preemption_mode='auto'"))
    if on_mesh:
        found.append(_Present(Feature.MESH, "a mesh"))
    if config.spec.enabled:
        found.append(_Present(Feature.SPECULATIVE, f"spec.method={config.spec.method!r}"))
    if make_strategy(config.context_reuse, **config.context_reuse_options).reuses:
        found.append(_Present(Feature.CONTEXT_REUSE,
                              f"context_reuse={config.context_reuse!r}"))
    if config.kv_arena:
        found.append(_Present(Feature.KV_ARENA, "kv_arena=True"))
    if config.controlled:
        found.append(_Present(Feature.CONTROLLER, f"controller={config.controller!r}"))
    if config.batch_invariant:
        found.append(_Present(Feature.BATCH_INVARIANT, "batch_invariant=True"))
    if config.fused_kv_write:
        found.append(_Present(Feature.FUSED_KV_WRITE, "fused_kv_write=True"))
    if config.retention_schedule == Feature.PYRAMID.value:
        found.append(_Present(Feature.PYRAMID, "retention_schedule='pyramid'"))
    for schedule in _HEAD_SPLITS:
        if config.retention_schedule == schedule.value:
            found.append(_Present(schedule, f"retention_schedule={schedule.value!r}"))
    if config.host_split != "never" and config.num_host_pages > 0:
        found.append(_Present(Feature.HOST_ROWS, f"host_split={config.host_split!r}"))
    if KVLayout(config.kv_layout) is KVLayout.CONTIGUOUS:
        found.append(_Present(Feature.CONTIGUOUS, "kv_layout='contiguous'"))
    elif config.enable_prefix_cache:
        found.append(_Present(Feature.PREFIX_CACHE, "enable_prefix_cache=True"))
    return found


_USE_SETTINGS = {Feature.SNAPSHOT: "snapshots", Feature.N_SAMPLES: "n > 1 sampling",
                 Feature.PAUSE: "pausing requests", Feature.SWAP: "pausing to host memory",
                 Feature.RECORD_DECISIONS: "record_decisions",
                 Feature.DISAGGREGATION: "prefill/decode disaggregation"}


def operations_of(engine: Any) -> tuple[Feature, ...]:
    """The features an `Engine` runs now besides its config's: a decision recording, the
    `Engine.operations` it joined (page transfers)."""
    recorded = (Feature.RECORD_DECISIONS,) if is_recorded(engine.scheduler) else ()
    return (*recorded, *sorted(engine.operations, key=lambda f: f.value))


def features_of(config: Any, *, on_mesh: bool = False) -> set[Feature]:
    """The features an `EngineConfig` (on a mesh or not) runs with.

    The prefix cache counts only on the paged layout (the contiguous one has none).
    """
    return {p.feature for p in _present(config, on_mesh)}


def check(config: Any, *, on_mesh: bool, uses: Iterable[Feature] = ()) -> None:
    """Raises ValueError when two features of `config` (plus `uses`) do not compose.

    Args:
      config: an `EngineConfig`.
      on_mesh: whether the engine runs on a tensor-parallel mesh.
      uses: features an operation adds to the engine's (e.g. `Feature.SNAPSHOT`); pairs with
        them are checked first.

    Raises:
      ValueError: naming both settings and the reason from `REFUSED`.
    """
    base = _present(config, on_mesh)
    added = [_Present(f, _USE_SETTINGS.get(f, f.value)) for f in uses]
    for a, b in [*itertools.combinations(added, 2), *itertools.product(added, base),
                 *itertools.combinations(base, 2)]:
        reason = refusal(a.feature, b.feature)
        if reason is not None:
            raise ValueError(f"{a.setting} and {b.setting} do not compose: {reason}")


def render_markdown() -> str:
    """The table as a markdown page: a matrix of the pairs, then each refusal's reason."""
    features = list(Feature)
    reasons = list(dict.fromkeys(REFUSED[frozenset(p)] for p in pairs()
                                 if frozenset(p) in REFUSED))
    works = sum(refusal(*p) is None for p in pairs())
    out = [
        "# Compatibility of KV behaviours",
        "",
        "Generated from `kvjax/engine/compat.py` by `scripts/make_compat_docs.py`; do not edit.",
        "Every pair of features composes unless marked; an engine (or a snapshot) with a",
        "refused pair raises `ValueError` naming both settings and the reason.",
        "`tests/engine/test_compatibility.py` runs every working pair and every refusal.",
        "",
        f"{len(pairs())} pairs: {works} work, {len(pairs()) - works} are refused.",
        "",
        "| feature | what it is |",
        "|---|---|",
        *(f"| `{f.value}` | {f.description} |" for f in features),
        "",
        "`ok`: works; `Rn`: refused, reason n below; `-`: one setting excludes the other.",
        "",
        "| | " + " | ".join(f"`{f.value}`" for f in features) + " |",
        "|---|" + "---|" * len(features),
    ]
    for a in features:
        cells = []
        for b in features:
            if a is b or (a.group is not None and a.group == b.group):
                cells.append("-")
            else:
                reason = refusal(a, b)
                cells.append("ok" if reason is None else f"R{reasons.index(reason) + 1}")
        out.append(f"| `{a.value}` | " + " | ".join(cells) + " |")
    out += ["", "## Reasons", ""]
    for i, reason in enumerate(reasons, 1):
        refused = [p for p in pairs() if refusal(*p) == reason]
        names = ", ".join(f"`{a.value}` + `{b.value}`" for a, b in refused)
        out.append(f"{i}. {reason[0].upper()}{reason[1:]}. ({names})")
    out += ["", "## Refused by the model", "",
            "An engine built for a model with one of these traits refuses the feature.", "",
            "| trait | what it is | feature | reason |", "|---|---|---|---|"]
    for (trait, feature), reason in MODEL_REFUSED.items():
        out.append(f"| `{trait.value}` | {trait.description} | `{feature.value}` | "
                   f"{reason[0].upper()}{reason[1:]}. |")
    return "\n".join(out) + "\n"
