"""Compiles every Pallas kernel and the engine step for GPUs and TPUs without the hardware.

Runs the case matrix of `kvjax.bench.deviceless` (programs x targets x dtypes x model shapes),
prints a markdown table (status, shared memory, registers, spills, compile seconds, the reason
for a refusal or failure) and writes every record as JSON. Needs the `deviceless` environment:

  make deviceless-setup
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-deviceless/bin/python \
      scripts/deviceless_compile.py --output_json=docs/results/deviceless_compile.json
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags  # noqa: E402

from kvjax.bench import deviceless  # noqa: E402

_TARGETS = flags.DEFINE_list("targets", list(deviceless.TARGETS), "Targets to compile for.")
_PROGRAMS = flags.DEFINE_list("programs", list(deviceless.PROGRAMS), "Kernels and steps.")
_DTYPES = flags.DEFINE_list("dtypes", list(deviceless.DTYPES), "Dtypes.")
_SHAPES = flags.DEFINE_list("shapes", list(deviceless.SHAPES), "Model shapes.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the records here.")


def main(argv):
    del argv
    records = deviceless.run(deviceless.all_cases(_TARGETS.value, _PROGRAMS.value,
                                                  _DTYPES.value, _SHAPES.value))
    print(deviceless.format_summary(records))
    print()
    print(deviceless.format_table(records))
    if _OUTPUT.value:
        path = pathlib.Path(_OUTPUT.value)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
