"""Prefill/decode disaggregation, the pure part: each replica's role and vLLM flags, the two requests the
client sends for one generation, and emptying a shared KV store.

One generation is two requests. The prefill replica gets the request with max_tokens = 1 and
`kv_transfer_params = {"do_remote_decode": true, ...}` (the protocol of vLLM's disaggregated-serving proxies):
it computes the prompt's KV and keeps it for the connector to hand over. Its answer's `kv_transfer_params`
(None for ExampleConnector, which needs none: the decode replica finds the KV by the prompt's tokens) go
with the unchanged request to a decode replica, which samples every token and logprob the caller gets.

RL must never decode with KV that older weights computed. Two rules keep it so:
- the decode request carries the prefill's `kv_transfer_params` only when the decode replica has the
  weight version the prefill replica had (`decode_body`); otherwise it is an ordinary request and the decode
  replica prefills by itself;
- a store that every replica reads by prompt content (ExampleConnector's directory) is emptied while every
  replica is paused for a weight update (`WeightFanOut.load_step`), so nothing computed before the
  update is found after it.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config.inference import (
    PER_REQUEST_CONNECTORS,
    SHARED_STORAGE_CONNECTOR,
    STORAGE_KEY,
    DisaggregationConfig,
    InferenceConfig,
)

NIXL_PORT_OFFSET = 1000
"""NixlConnector's side channel listens on the server's API port + this (each replica its own)."""

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""`kv_transfer_params` of a prefill request: keep the KV for a decode elsewhere."""


@dataclass(frozen=True)
class Prefill:
    """What a prefill replica answered: its weight version when the request was sent and the
    `kv_transfer_params` for the decode request (None: the connector needs none)."""

    url: str
    version: int
    params: dict[str, Any] | None


def kv_role(disagg: DisaggregationConfig) -> str:
    """vLLM's `kv_role` of a replica: ExampleConnector and NixlConnector replicas both send and receive
    (`kv_both`, as vLLM's own examples run them); other connectors are told which side they are."""
    if disagg.shared_storage or disagg.connector in PER_REQUEST_CONNECTORS:
        return "kv_both"
    return "kv_producer" if disagg.role == "prefill" else "kv_consumer"


def vllm_flags(disagg: DisaggregationConfig) -> list[str]:
    """`--kv-transfer-config` (and `--block-size`) of one replica."""
    transfer = {
        "kv_connector": disagg.connector,
        "kv_role": kv_role(disagg),
        "kv_connector_extra_config": disagg.connector_config,
    }
    flags = ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if disagg.block_size is not None:
        flags += ["--block-size", str(disagg.block_size)]
    return flags


def server_env(disagg: DisaggregationConfig, host: str, port: int) -> dict[str, str]:
    """NixlConnector's side channel (where decode replicas ask for the KV): on the server's own address, on a
    port of its own, so replicas on one machine do not collide."""
    if disagg.connector != "NixlConnector":
        return {}
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + NIXL_PORT_OFFSET)}


def with_roles(replicas: list[InferenceConfig], storage: Path | None) -> list[InferenceConfig]:
    """The replicas (one config each, ports and cores set), each given its role: the first
    `num_prefill_replicas` prefill, the rest decode. ExampleConnector's directory is `storage` unless
    `connector_config` names one. Replicas without disaggregation are returned as they are."""
    disagg = replicas[0].disaggregation if replicas else None
    if disagg is None:
        return replicas
    connector_config = dict(disagg.connector_config)
    if disagg.shared_storage and STORAGE_KEY not in connector_config and storage is not None:
        connector_config[STORAGE_KEY] = str(storage.absolute())  # servers and client may differ in cwd
    placed = []
    for index, replica in enumerate(replicas):
        role = "prefill" if index < disagg.num_prefill_replicas else "decode"
        update = {"role": role, "connector_config": connector_config}
        placed.append(replica.model_copy(update={"disaggregation": disagg.model_copy(update=update)}))
    return placed


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request of generation request `body`: one prompt, one token, its KV kept for the decode."""
    prefill = {**body, "max_tokens": 1, "min_tokens": 0, "n": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
    prefill.pop("stream", None)
    prefill.pop("stream_options", None)
    return prefill


def decode_body(body: dict[str, Any], prefill: Prefill, decode_version: int) -> dict[str, Any]:
    """The decode request: `body` with the prefill's `kv_transfer_params` when the decode replica serves the
    weights that computed them; else `body` alone (it prefills itself: slower, never stale)."""
    if prefill.params is None or prefill.version != decode_version:
        return body
    return {**body, "kv_transfer_params": prefill.params}


def empty_store(path: Path) -> int:
    """Delete everything under ExampleConnector's directory (keeping the directory); returns the entries
    removed. Only while no replica runs a request: a file written meanwhile could survive."""
    removed = 0
    if not path.is_dir():
        return removed
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    return removed


def storage_of(replicas: list[InferenceConfig]) -> Path | None:
    """The shared KV directory the replicas use (ExampleConnector), if any."""
    for replica in replicas:
        disagg = replica.disaggregation
        if disagg is not None and disagg.connector == SHARED_STORAGE_CONNECTOR:
            path = disagg.storage_path()
            return None if path is None else Path(path)
    return None
