"""configs/ray_serve.yaml as `serve run` / `serve deploy` read it, without a cluster: its import path names the
application builder, every arg is a Strata setting the one validation accepts, and the builder makes the two
deployments with the file's replica count and per-replica resources; a wrong key is refused by name."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from strata.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ray_serve.yaml"


def _app():
    spec = yaml.safe_load(CONFIG.read_text())
    (app,) = spec["applications"]
    module, name = app["import_path"].split(":")
    return getattr(importlib.import_module(module), name), dict(app["args"])


def test_the_serve_config_builds_the_application_it_describes():
    build, args = _app()
    graph = build(args)
    ingress = graph._bound_deployment                       # Serve's Application: the bound ingress deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (ingress.name, engine.name) == ("Ingress", "EngineReplica")
    assert engine.num_replicas == args["replicas"]
    assert engine.ray_actor_options["num_gpus"] == args["gpus_per_replica"]
    assert engine.ray_actor_options["num_cpus"] == args["cpus_per_replica"]


def test_a_wrong_key_in_the_serve_config_is_refused_by_name():
    build, args = _app()
    with pytest.raises(ConfigError, match="replica_count"):
        build({**args, "replica_count": 2})
