"""The floors of tidal's import graph, bottom up: which floor each top-level module or package of `tidal` is on.

The rule (DESIGN.md, checked by tests/unit/test_import_layers.py on the source, nothing imported):

- a module imports only from its own floor or from floors below it, never from a floor above;
- no import cycle between modules, of any length, counting imports inside functions and `__init__`
  re-exports (so two packages of one floor may import each other's modules only one way);
- production code never imports `tidal.testing`: it is test support, the top floor, and may import anything.

A new top-level module or package gets a floor here before the test accepts it.
"""

GROUND = 1
CONFIG = 2
TRANSPORT = 3
INFERENCE = 4
ROLLOUT = 5
ROLES = 6
LAUNCH = 7
COMMANDS = 8
TESTING = 9

FLOORS: dict[str, int] = {
    # 1. the ground: named types, errors, the process wrapper, the checkpoint manifest, model names and files
    "__init__": GROUND,  # the `tidal` package itself (its version)
    "layers": GROUND,
    "types": GROUND,
    "errors": GROUND,
    "process": GROUND,
    "manifest": GROUND,
    "models": GROUND,
    # 2. the config tree (environment names included) and every path inside an output directory
    "config": CONFIG,
    "run_layout": CONFIG,
    # 3. moving rollouts and weights between processes; console, jsonl, wandb and plots
    "transport": TRANSPORT,
    "monitor": TRANSPORT,
    # 4. the vLLM server wrapper, its RL routes and weight engines, the client
    "inference": INFERENCE,
    # 5. environments (chat continuation included) and what orchestrator and eval share to run rollouts
    "envs": ROLLOUT,
    "rollout": ROLLOUT,
    # 6. the process roles
    "trainer": ROLES,
    "eval": ROLES,
    "orchestrator": ROLES,
    # 7. starting the roles: local supervision (launcher), Slurm and Kubernetes (deploy)
    "launcher": LAUNCH,
    "deploy": LAUNCH,
    # 8. the commands
    "cli": COMMANDS,
    "__main__": COMMANDS,
    "demo": COMMANDS,
    # test support: tiny models' fixtures, pinned real-model assets
    "testing": TESTING,
}


def floor_of(module: str) -> int:
    """The floor of a dotted module name under `tidal` (`tidal.inference.client` -> 4)."""
    parts = module.split(".")
    assert parts[0] == "tidal", module
    return FLOORS[parts[1] if len(parts) > 1 else "__init__"]
