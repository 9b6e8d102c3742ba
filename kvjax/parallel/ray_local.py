"""A local Ray instance on loopback, for batch jobs and rollout workers on one machine.

Ray on Linux binds its GCS and raylets to the machine's network address (it resolves even an
explicit 127.0.0.1 to it); its switch for loopback-only local instances is the
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` environment variable, read when Ray is first imported.
"""

from __future__ import annotations

import os
import sys


def init_local_ray(num_cpus: int) -> None:
    """Starts a local Ray instance with `num_cpus` CPUs, no dashboard, bound to 127.0.0.1.

    Raises ValueError if Ray was imported already without the loopback switch (its
    services would listen on the network).
    """
    if not isinstance(num_cpus, int) or num_cpus < 1:
        raise ValueError(f"num_cpus must be a positive int, got {num_cpus!r}")
    if "ray" not in sys.modules:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray  # An optional extra.
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise ValueError("ray was imported before init_local_ray without "
                         "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; it would listen on the network")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
