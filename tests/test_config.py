"""Settings declared once (strata/config.py): one name per setting across the groups, defaults and examples that pass
their own rule, flat keys into groups through the one validation, flag text typed from the field, and the generated
files (configs/demo.toml, docs/configuration.md) equal to what the fields generate."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from strata import config as C
from strata.config import SPECS, Settings, check, load_settings
from strata.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_has_one_group_a_help_and_a_default_its_rule_allows():
    names = [f.name for cls in C.GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(SPECS)
    for spec in SPECS.values():
        assert spec.help.endswith(".") and spec.rule.allowed, spec.key
        assert spec.default is None or spec.rule.ok(spec.default), spec.key
        assert spec.example is None or spec.rule.ok(spec.example), spec.key
        assert (spec.default is None) == (spec.example is not None), spec.key     # demo.toml shows each unset one
    s = Settings()
    assert all(getattr(getattr(s, spec.group), key) == spec.default for key, spec in SPECS.items())
    # the defaults the engine and the server share (the server's former ones)
    assert (s.sched.prefill, s.model.max_context, s.sched.parallel) == (512, "auto", 2)
    assert "sequences" not in SPECS and "n_slots" not in SPECS


def test_flat_settings_go_to_their_groups():
    s = Settings.build(max_context=2048, prefill=64, expert_cache=8, backend="jax", miss_policy="cpu")
    assert (s.model.max_context, s.sched.prefill, s.experts.expert_cache, s.backend.backend,
            s.experts.miss_policy) == (2048, 64, 8, "jax", "cpu")
    assert s.with_values({"parallel": 3}).sched == C.SchedSettings(parallel=3, prefill=64)
    assert s.model_name == "demo" and Settings.build(model="/models/Qwen3-Next/").model_name == "Qwen3-Next"


@pytest.mark.parametrize("flat, words", [
    (dict(sequences=2), ["unknown key 'sequences'", "allowed keys: model, dtype"]),
    (dict(max_contxt=2), ["unknown key 'max_contxt' (did you mean 'max_context'?)"]),
    (dict(expert_cache=0), ["expert_cache = 0 is not allowed", 'expert_cache must be "auto" or a number of experts']),
    (dict(window_fetch=1), ["window_fetch = 1 is not allowed; window_fetch must be true or false"]),
    (dict(adapt_decay=0.0), ["adapt_decay = 0.0 (a float) is not allowed; adapt_decay must be a number in (0, 1]"]),
    (dict(host_chunk_mib=4096), ["host_chunk_mib = 4096 is not allowed", "an integer in [1, 2047]"]),
    (dict(miss_policy="gpu"), ['miss_policy = "gpu" (a string) is not allowed', "one of fetch, cpu"]),
    (dict(prefill=True), ["prefill = true (a boolean) is not allowed"]),
])
def test_the_one_validation_names_the_key_the_value_and_what_is_allowed(flat, words):
    with pytest.raises(ConfigError) as ei:
        Settings.build(**flat)
    for w in words:
        assert w in str(ei.value)


def test_flag_text_takes_the_fields_type_and_errors_name_the_flag():
    assert [SPECS["expert_cache"].from_text(t) for t in ("8", "auto", "lots")] == [8, "auto", "lots"]
    assert SPECS["resident_budget_gib"].from_text("48") == 48.0 and SPECS["port"].from_text("80") == 80
    assert SPECS["prefill"].from_text("1.5") == "1.5"                # left as text for the check to refuse
    with pytest.raises(ConfigError, match=r'^--expert-cache lots is not allowed; expert_cache must be "auto" or a '
                                          r'number of experts in \[1, 16777216\]$'):
        load_settings(None, {"expert_cache": "lots"}, env={})
    with pytest.raises(ConfigError, match=r"^--prefill 1.5 is not allowed; prefill must be an integer in "):
        check("prefill", "1.5", as_flag=True)


def test_a_bad_environment_value_is_overridden_by_the_flag_not_refused_first():
    assert load_settings(None, {"api_key": "k"}, env={"STRATA_API_KEY": " spaced "}).serve.api_key == "k"
    with pytest.raises(ConfigError, match="api_key"):
        load_settings(None, {}, env={"STRATA_API_KEY": " spaced "})


def test_demo_toml_is_generated_from_the_fields():
    text = (ROOT / "configs" / "demo.toml").read_text()
    assert text == C.demo_toml(), "configs/demo.toml differs from the settings: run `make docs`"
    for spec in SPECS.values():                  # each help is the comment above its key
        assert " ".join(spec.help.split()[:6]) in " ".join(text.replace("# ", " ").split()), spec.key


def test_configuration_docs_are_generated_from_the_fields():
    text = (ROOT / "docs" / "configuration.md").read_text()
    from strata.cli import configuration_markdown
    assert text == configuration_markdown(), "docs/configuration.md differs from the settings and commands: `make docs`"
    for spec in SPECS.values():
        assert f"| `{spec.key}` | `{spec.flag}`" in text and spec.help.replace("|", "\\|") in text, spec.key


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_deployment_file_is_valid_and_documented(path):
    """configs/*.toml load through the one validation, and docs/operations.md says what each is for."""
    load_settings(path, env={})
    assert f"configs/{path.name}" in (ROOT / "docs" / "operations.md").read_text()


def test_checkpoint_every_auto_is_the_prefill_size():
    """Prompt parts end at checkpoint positions: auto spaces checkpoints by the part size, a number as given."""
    assert Settings.build().sched.checkpoint_tokens == Settings.build().sched.prefill
    assert Settings.build(prefill=4096).sched.checkpoint_tokens == 4096
    assert Settings.build(prefill=4096, checkpoint_every=512).sched.checkpoint_tokens == 512
    with pytest.raises(ConfigError, match="checkpoint_every .* is not allowed.*\"auto\" or an integer"):
        Settings.build(checkpoint_every=0)
