"""The run configuration: help carried by the schemas, the one async setting, renamed keys and
flags still read for a release (each with a warning naming its replacement), and defaults that
depend on other keys resolved from the values a run gives."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from slimish.config import RunConfig, load_run_config
from slimish.engine.config import EngineConfig
from slimish.flags import add_config_arguments, config_from_args
from slimish.launch.config import ServeConfig
from slimish.router.config import RouterConfig
from slimish.schema import doc, doc_factory, field_docs
from slimish.trainer.config import TrainerConfig

BASE = ["model=m", "data.source=x"]


def test_help_is_schema_metadata_that_omegaconf_accepts():
    @dataclasses.dataclass
    class Schema:
        port: int = doc(30000, "the port")
        names: list[str] = doc_factory(list, "some names")
        bare: int = 1

    assert field_docs(Schema) == {"port": "the port", "names": "some names"}
    assert OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Schema), {"names": ["a"]})) == Schema(names=["a"])


def test_a_field_has_only_its_own_help():
    """A group's help reaches the fields it documents, not the next undocumented field (the
    comment-reading regex gave `log_level` the parsers' help and `lr` the Megatron spec's)."""
    engine, trainer = field_docs(EngineConfig), field_docs(TrainerConfig)
    assert engine["tool_call_parser"] == engine["reasoning_parser"] and "log_level" not in engine
    assert "Megatron" in trainer["megatron_spec"] and "Megatron" not in trainer["lr"] + trainer["betas"]


def test_async_training_is_one_setting():
    assert not load_run_config(None, BASE).async_training
    assert load_run_config(None, [*BASE, "async_training=true", "buffer.max_staleness=1"]).async_training
    with pytest.raises(SystemExit, match=r"async_training needs buffer.max_staleness >= 1"):
        load_run_config(None, [*BASE, "async_training=true"])


def test_the_old_mode_key_still_reads_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """`mode: async` meant async only with a staleness bound >= 1 (0 ran as sync): it still does."""
    (tmp_path / "old.yaml").write_text("model: m\ndata:\n  source: x\nmode: async\nbuffer:\n  max_staleness: 1\n")
    with caplog.at_level(logging.WARNING, logger="slimish.config"):
        assert load_run_config(str(tmp_path / "old.yaml")).async_training
    assert "mode is now async_training" in caplog.text
    assert not load_run_config(None, [*BASE, "mode=async"]).async_training
    assert not load_run_config(str(tmp_path / "old.yaml"), ["mode=sync"]).async_training
    with pytest.raises(SystemExit, match=r"mode must be one of sync, async, got 'ray'"):
        load_run_config(None, [*BASE, "mode=ray"])
    assert "mode" not in RunConfig.__dataclass_fields__  # only launch.mode is a mode now


def test_router_processes_old_names_still_read_with_a_warning(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="slimish.config"):
        assert load_run_config(None, [*BASE, "launch.router_workers=3"]).launch.router_processes == 3
    assert "launch.router_workers is now launch.router_processes" in caplog.text
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RouterConfig)
    with caplog.at_level(logging.WARNING, logger="slimish.flags"):
        assert config_from_args(RouterConfig, parser.parse_args(["--workers", "2"])).processes == 2
    assert "--workers is now --processes" in caplog.text and "--workers" not in parser.format_help()
    serve = argparse.ArgumentParser()  # `slimish serve` runs one router process: neither name is a flag there
    add_config_arguments(serve, ServeConfig)
    add_config_arguments(serve, RouterConfig, skip=("worker_urls", "processes"))
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "m", "--workers", "2"])


def test_a_default_derived_from_other_keys_follows_the_given_values():
    """`launch.start_timeout` (None: 1800 s when SGLang engines start) was fixed at 300 before the
    run's keys were read, because OmegaConf builds each section's defaults by calling it."""
    timeout = lambda *kv: load_run_config(None, [*BASE, *kv]).launch.start_timeout  # noqa: E731
    assert timeout() == 300 and timeout("launch.engine_kind=sglang") == 1800
    assert timeout("launch.teacher.engine_kind=sglang") == 1800
    assert timeout("launch.engine_kind=sglang", "launch.start_timeout=60") == 60
