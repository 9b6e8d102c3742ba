"""Writes docs/api.md, the public API reference, from the docstrings and signatures of kvjax.

    .venv/bin/python scripts/make_api_docs.py           # regenerate docs/api.md
    .venv/bin/python scripts/make_api_docs.py --check   # exit 1 if docs/api.md is out of date

The reference is generated, not written, so it stays true: tests/test_api_docs.py fails when a
public signature or docstring changes without a regeneration. SECTIONS below lists what is
public: a package's `__all__`, or the names picked from a module without one. Each object is
documented once, under the first section that lists it; later sections point back to it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pathlib
import pprint
import re
import sys
import textwrap
from typing import Any

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parent.parent
API_MD = REPO / "docs" / "api.md"
MAX_SIGNATURE_LINE = 96


@dataclasses.dataclass(frozen=True)
class Section:
    """One module's part of the reference.

    Attributes:
      module: the dotted module name.
      names: the public names documented, in order; None: the module's `__all__`.
    """

    module: str
    names: tuple[str, ...] | None = None


SECTIONS = (
    Section("kvjax"),
    Section("kvjax.engine.request", ("CompletionOutput", "WeightUpdatePolicy", "SeqStatus")),
    Section("kvjax.engine.core", ("EngineCore",)),
    Section("kvjax.engine.runner", ("ModelRunner", "StepBuckets", "StepObserver")),
    Section("kvjax.scheduler.scheduler", ("Scheduler", "SchedulerConfig")),
    Section("kvjax.scheduler.output", ("ScheduledRow", "SchedulerOutput", "RunnerOutput")),
    Section("kvjax.scheduler.replay", ("DecisionRecorder", "DecisionTrace", "Event",
                                       "SchedulerRecipe", "replay", "build_scheduler",
                                       "ReplayResult", "ReplayMismatch", "ReplayDevice",
                                       "ReplayClock", "decision")),
    Section("kvjax.memory.kv_cache_manager", ("KVCacheManager",)),
    Section("kvjax.memory.ops", ("KVOp", "KVOpKind", "KVDevice", "HostKV")),
    Section("kvjax.grammar", ("GrammarCompiler", "GrammarMatcher", "mask_width")),
    Section("kvjax.engine.snapshot", ("save_snapshot", "restore_snapshot")),
    Section("kvjax.engine.multi", ("MultiModelEngine", "ModelSpec", "PoolConfig")),
    Section("kvjax.memory.frames", ("FramePool", "Owner", "OwnerPages", "PoolPolicy",
                                    "StaticPartition", "ElasticLRU", "POOL_POLICIES",
                                    "register_pool_policy", "make_pool_policy")),
    Section("kvjax.kv.arena", ("ArenaKV", "FrameLayout", "frame_layout", "arena_codecs",
                               "init_arena")),
    Section("kvjax.kv.state", ("KVState", "PagedKV", "ContiguousKV", "init_paged_kv",
                               "init_contiguous_kv", "pages_for", "num_pages_for_budget")),
    Section("kvjax.kv.pages", ("gather_pages", "scatter_pages", "zero_pages", "take", "put")),
    Section("kvjax.kv.quantized", ("QuantizedPagedKV", "init_quantized_kv", "make_codec",
                                   "kv_bytes_per_token")),
    Section("kvjax.kv.codecs", ("KVCodec", "CODECS", "get_codec", "IdentityCodec", "Int8Codec",
                                "IntCodec", "Fp8Codec", "Fp8Format", "Fp8Scaling", "KiviCodec",
                                "pack_codes", "unpack_codes")),
    Section("kvjax.kv.retention", ("RetentionPolicy", "CacheView", "register_retention",
                                   "retention_names", "make_retention", "NoRetention",
                                   "StreamingLLM", "H2O", "SnapKV", "Quest", "Pooling")),
    Section("kvjax.kv.presses", ("TOVA", "KNorm", "ExpectedAttention", "ObservedAttention",
                                 "key_norm_scores_blockwise", "expected_attention_blockwise",
                                 "query_statistics", "mean_rotation")),
    Section("kvjax.kv.budgets", ("BudgetScheme", "BudgetSchedule", "HeadAllocation",
                                 "pyramid_budgets", "adakv_head_budgets", "layer_slots",
                                 "budget_layer_groups", "pages_held")),
    Section("kvjax.kv.quest", ("QuestKV", "init_quest_kv")),
    Section("kvjax.scheduler.policies", ("SchedulingPolicy", "POLICIES", "register_policy",
                                         "make_policy", "FCFS", "Priority", "LongestPrefixMatch",
                                         "FairShare")),
    Section("kvjax.scheduler.preemption", ("decide_preemption", "PreemptionDecision")),
    Section("kvjax.scheduler.spec", ("SpecConfig", "Drafter", "DRAFTERS", "register_drafter",
                                     "make_drafter", "NgramDrafter", "SparseSelfDrafter")),
    Section("kvjax.memory.tiers", ("TierConfig", "TransferLayout", "measure_transfer_bandwidth")),
    Section("kvjax.router"),
    Section("kvjax.router.http", ("RouterConfig", "HttpRouter", "build_router_app",
                                  "serve_router")),
    Section("kvjax.router.replicas", ("ReplicaSet", "Replica", "ReplicaState", "InFlight",
                                      "prompt_page_hashes")),
    Section("kvjax.router.phases", ("PhaseSchedule",)),
    Section("kvjax.rl"),
    Section("kvjax.batch"),
    Section("kvjax.bench"),
    Section("kvjax.parallel"),
    Section("kvjax.server"),
    Section("kvjax.server.kv_state", ("kv_state", "affinity_key", "AffinityBook")),
    Section("kvjax.testing", ("TINY", "tiny_model", "greedy_reference", "dense_logprobs",
                              "ByteTokenizer", "tiny_tokenizer", "tiny_chat_model",
                              "save_hf_checkpoint")),
)

_SECTION_HEADS = re.compile(r"^(Args|Arguments|Attributes|Returns|Raises|Yields|Example|Examples"
                            r"|Note|Notes):\s*$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _Annotation:
    """Prints a string annotation bare (inspect would quote it)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _anchor(qualified: str) -> str:
    """The GitHub-style anchor of a heading made of `qualified` in backticks."""
    return re.sub(r"[^a-z0-9_\- ]", "", qualified.lower()).replace(" ", "-")


def _names(section: Section) -> tuple[str, ...]:
    module = importlib.import_module(section.module)
    if section.names is not None:
        return section.names
    if not hasattr(module, "__all__"):
        raise ValueError(f"{section.module} has no __all__; list its public names in SECTIONS")
    return tuple(module.__all__)


def _bare(annotation: Any) -> Any:
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def _default(value: Any) -> Any:
    """A default as code would name it: `Mode.X` for an enum, `module.name` for a function."""
    if value is inspect.Parameter.empty:
        return value
    if isinstance(value, enum.Enum):
        return _Annotation(f"{type(value).__name__}.{value.name}")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            is_default = type(value)() == value
        except TypeError:
            is_default = False
        return _Annotation(f"{type(value).__name__}({'' if is_default else '...'})")
    if (inspect.isroutine(value) or inspect.isclass(value)) and hasattr(value, "__qualname__"):
        module = getattr(value, "__module__", None) or "builtins"
        prefix = "" if module == "builtins" else f"{module}."
        return _Annotation(f"{prefix}{value.__qualname__}")
    return value


def format_signature(name: str, obj: Any, *, drop_first: bool = False) -> str | None:
    """`name(params) -> ret`, one parameter a line when long; None when there is none.

    drop_first: leave out the first parameter (a method's self or cls).
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    params = [p.replace(annotation=_bare(p.annotation),
                        default=_default(p.default)) for p in params]
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        factories = {f.name: f.default_factory for f in dataclasses.fields(obj)
                     if f.default_factory is not dataclasses.MISSING}
        made = {name: repr(_default(f)) for name, f in factories.items()}
        params = [p.replace(default=_Annotation("<factory>" if "<" in made[p.name]
                                                else f"{made[p.name]}()"))
                  if p.name in factories else p for p in params]
    ret = inspect.Signature.empty if inspect.isclass(obj) else _bare(sig.return_annotation)
    sig = sig.replace(parameters=params, return_annotation=ret)
    text = _ADDRESS.sub("", f"{name}{sig}")
    if len(text) <= MAX_SIGNATURE_LINE:
        return text
    # Re-render one parameter a line, keeping the `/` and `*` markers that str(sig) adds.
    body = _ADDRESS.sub("", str(sig.replace(return_annotation=inspect.Signature.empty)))[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    ret = sig.return_annotation
    tail = "" if ret is inspect.Signature.empty else f" -> {_ADDRESS.sub('', repr(ret))}"
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts if p) + f"){tail}"


def format_docstring(doc: str | None) -> str:
    """Markdown from a Google-style docstring: paragraphs, code blocks, bulleted sections."""
    if not doc:
        return ""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _SECTION_HEADS.match(line)
        if head:
            items, i = _section_items(lines, i + 1)
            out += ["", f"**{head.group(1)}**", ""] + items + [""]
            continue
        if line.startswith("  ") and (not out or not out[-1].strip()):
            # An indented block after a blank line (code, a table): kept verbatim.
            block = []
            while i < len(lines) and (lines[i].startswith("  ") or not lines[i].strip()):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        out.append(line)
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _section_items(lines: list[str], i: int) -> tuple[list[str], int]:
    """Bullets for the indented lines of one docstring section starting at lines[i]."""
    items: list[str] = []
    indent = None
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        line = lines[i]
        i += 1
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        text = line.strip()
        if depth > indent and items:
            items[-1] += " " + text
            continue
        key, sep, rest = text.partition(": ")
        if sep and re.fullmatch(r"[\w.*, ]+", key):
            items.append(f"- `{key}`: {rest}")
        else:
            items.append(f"- {text}")
    return items, i


def _member_functions(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by `cls` itself (in kvjax), in source order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if not callable(func) or not getattr(func, "__module__", "").startswith("kvjax"):
            continue
        if inspect.isclass(func):
            continue
        members.append((name, value))
    return members


def render_class(qualified: str, cls: type) -> list[str]:
    out = []
    if issubclass(cls, enum.Enum):
        out += [f"`enum` {format_docstring(cls.__doc__)}", ""]
        out += [f"- `{member.name}` = `{member.value!r}`" for member in cls]
        return out
    signature = None
    if not _is_protocol(cls):
        signature = format_signature(cls.__name__, cls)
    if signature:
        out += ["```python", f"class {signature}", "```", ""]
    elif _is_protocol(cls):
        out += ["`Protocol`", ""]
    out.append(format_docstring(cls.__doc__))
    if _is_protocol(cls) and cls.__dict__.get("__annotations__"):
        out += ["", "**Members**", ""]
        out += [f"- `{name}: {_bare(annotation)!r}`"
                for name, annotation in cls.__dict__["__annotations__"].items()]
    for name, value in _member_functions(cls):
        if isinstance(value, property):
            out += ["", f"#### `{cls.__name__}.{name}` (property)", "",
                    format_docstring(value.fget.__doc__)]
            continue
        plain = getattr(value, "__func__", value)
        signature = format_signature(f"{cls.__name__}.{name}", plain,
                                     drop_first=not isinstance(value, staticmethod))
        out += ["", f"#### `{cls.__name__}.{name}`", "", "```python", signature or name, "```",
                "", format_docstring(getattr(value, "__doc__", None))]
    return out


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def render_value(value: Any) -> list[str]:
    """A registry (dict of name -> factory or class) or a constant."""
    if isinstance(value, dict):
        # Entries registered from outside kvjax (a test, a notebook) are not part of its API.
        value = {key: item for key, item in value.items()
                 if getattr(item, "__module__", "kvjax").startswith("kvjax")}
        rows = []
        for key, item in value.items():
            target = getattr(item, "__qualname__", "")
            public = target and not any(p.startswith(("_", "<")) for p in target.split("."))
            rows.append(f"- `{key!r}`" + (f": `{item.__module__}.{target}`" if public else ""))
        return [f"A registry of {len(value)} entries:", "", *rows]
    if isinstance(value, (tuple, frozenset, set, list)):
        return ["```python", _ADDRESS.sub("", pprint.pformat(value, width=MAX_SIGNATURE_LINE)),
                "```"]
    return [f"`{_ADDRESS.sub('', repr(value))}`"]


def render_object(qualified: str, name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        return render_class(qualified, obj)
    if callable(obj):
        signature = format_signature(name, obj)
        return ["```python", signature or name, "```", "", format_docstring(obj.__doc__)]
    return render_value(obj)


def render() -> str:
    """The text of docs/api.md."""
    out = ["# kvjax API reference", "",
           "Generated from the docstrings and signatures by `scripts/make_api_docs.py`; do not "
           "edit by hand.", "Regenerate with `.venv/bin/python scripts/make_api_docs.py` "
           "(`tests/test_api_docs.py` checks it is current).", "",
           "For how the pieces fit together see [architecture.md](architecture.md); for "
           "runnable", "examples, the notebooks in [colab/](../colab/README.md).", "",
           "## Contents", ""]
    out += [f"- [`{s.module}`](#{_anchor(s.module)})" for s in SECTIONS]
    documented: dict[int, str] = {}
    for section in SECTIONS:
        module = importlib.import_module(section.module)
        out += ["", f"## `{section.module}`", ""]
        summary = format_docstring(module.__doc__)
        if summary:
            out += [summary, ""]
        for name in _names(section):
            if not hasattr(module, name):
                raise ValueError(f"{section.module} has no public name {name!r}")
            obj = getattr(module, name)
            qualified = f"{section.module}.{name}"
            key = id(obj)
            if (inspect.isclass(obj) or inspect.isroutine(obj)) and key in documented:
                first = documented[key]
                out += [f"### `{qualified}`", "", f"The same object as [`{first}`]"
                        f"(#{_anchor(first)}).", ""]
                continue
            if inspect.isclass(obj) or inspect.isroutine(obj):
                documented[key] = qualified
            out += [f"### `{qualified}`", "", *render_object(qualified, name, obj), ""]
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip() + "\n"


FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "Exit 1 if docs/api.md differs from the generated text.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    text = render()
    if FLAGS.check:
        if not API_MD.exists() or API_MD.read_text() != text:
            sys.exit(f"{API_MD} is out of date: run .venv/bin/python scripts/make_api_docs.py")
        print(f"{API_MD} is up to date")
        return
    API_MD.write_text(text)
    print(f"wrote {API_MD} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    app.run(main)
