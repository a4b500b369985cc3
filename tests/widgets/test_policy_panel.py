"""What a user sees in the policy panel, and its policy form generated from engine.sparse.SPECS (pytest-qt,
offscreen)."""
import pytest
from PySide6.QtCore import Qt

from widgets.policy_panel import PolicyPanel


@pytest.fixture
def policy(qtbot):
    panel = PolicyPanel()
    qtbot.addWidget(panel)
    panel.show()
    return panel


def _quest_item(panel):
    return panel.policy_combo.model().item(panel.policy_combo.findData("quest"))


def test_quest_is_disabled_in_gpu_mode_with_the_reason(policy):
    assert policy.mode() == "gpu"
    assert not _quest_item(policy).isEnabled()
    assert "gpu mode" in policy.policy_tooltip("quest") and "layerwise" in policy.policy_tooltip("quest")
    assert not policy.ring_slots.isEnabled() and "offload modes" in policy.ring_slots.toolTip()
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("layerwise"))
    assert _quest_item(policy).isEnabled() and "Not available" not in policy.policy_tooltip("quest")
    assert policy.ring_slots.isEnabled() and policy.budget_check.isEnabled()
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("chunked"))
    assert _quest_item(policy).isEnabled() and "Not available" not in policy.policy_tooltip("quest")
    assert not policy.policy_available("minference")
    assert "chunked" in policy.policy_tooltip("xattention") and not policy.budget_check.isEnabled()


def test_quest_falls_back_to_full_when_switching_to_gpu(policy):
    policy.set_config({"mode": "layerwise", "policy": "quest"})
    assert policy.policy() == "quest"
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("gpu"))
    assert policy.policy() == "full" and "Quest" in policy.note_label.text() and policy.note_label.isVisible()


def test_config_round_trips_and_changes_are_signalled(policy, qtbot):
    cfg = {"mode": "layerwise", "kv_block_size": 512, "ring_slots": 5, "host_kv_gb": 32.0,
           "prefill_chunk_tokens": 4096, "gpu_kv_budget_gb": 2.5, "policy": "quest",
           "policy_params": {"token_budget": 4096, "page_size": 32, "sink": 32, "recent": 48,
                                             "dense_layers": 1, "min_context": 2048, "min_layer_mb": 8.0, "look_ahead": False, "bound_tokens": 8, "rank": 0, "centroid": False,
                                             "recall": False}}
    with qtbot.assertNotEmitted(policy.config_changed):
        policy.set_config(cfg)
    assert policy.config() == cfg
    other = PolicyPanel()
    qtbot.addWidget(other)
    other.set_config(policy.config())
    assert other.config() == cfg
    other.set_config({"prefill_chunk_tokens": None})                # auto: the engine sizes it
    assert other.config()["prefill_chunk_tokens"] is None and other.prefill_chunk.text() == "auto"
    xa = {"mode": "gpu", "kv_block_size": 256, "policy": "xattention",
          "policy_params": {"threshold": 0.8, "stride": 8, "min_len": 4096, "cpu_dense_above": 0.35,
                            "gpu_dense_above": 0.45}}
    other.set_config(xa)
    assert other.config() == xa   # no offload knobs in gpu mode

    with qtbot.waitSignal(policy.config_changed) as changed:
        policy.ring_slots.setValue(2)
    assert changed.args[0]["ring_slots"] == 2 and changed.args[0]["policy"] == "quest"
    with qtbot.waitSignal(policy.config_changed) as changed:
        policy.policy_combo.setCurrentIndex(policy.policy_combo.findData("minference"))
    assert changed.args[0]["policy_params"] == {"vertical": 1000, "slash": 6096, "min_len": 8192,
                                                  "cpu_dense_above": 0.35, "gpu_dense_above": 0.45}   # the engine's
    mi = {"mode": "gpu", "kv_block_size": 256, "policy": "minference",
          "policy_params": {"vertical": 0.05, "slash": 2048, "min_len": 1024, "cpu_dense_above": 1.0,
                            "gpu_dense_above": 1.0}}  # a fraction, counts
    other.set_config(mi)
    assert other.config() == mi


def test_sparse_policy_defaults_are_the_engines(policy):
    from engine.sparse import SPECS, make_policy
    for key in ("minference", "xattention"):
        policy.policy_combo.setCurrentIndex(policy.policy_combo.findData(key))
        params = policy.config()["policy_params"]
        assert params == {p.name: p.default for p in SPECS[key].params if p.panel}, key   # the engine's defaults
        make_policy(key, params, "gpu")                    # the engine takes them as they are
    assert list(policy.config()["policy_params"]) == ["threshold", "stride", "min_len", "cpu_dense_above",
                                                       "gpu_dense_above"]


def test_policies_the_engine_lacks_are_disabled(policy):
    from engine import POLICIES as ENGINE_POLICIES
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("layerwise"))
    policy.set_engine_policies(ENGINE_POLICIES)
    model = policy.policy_combo.model()
    assert all(model.item(policy.policy_combo.findData(k)).isEnabled() for k in ENGINE_POLICIES)
    policy.set_engine_policies(["full", "quest"])
    assert not model.item(policy.policy_combo.findData("xattention")).isEnabled()
    assert "not in the running engine" in policy.policy_tooltip("xattention")


def test_busy_label_and_load_progress(policy, qtbot):
    assert not policy.busy_label.isVisible()
    policy.set_busy(True)
    assert policy.busy_label.isVisible() and "next turn" in policy.busy_label.text()
    assert policy.mode_combo.isEnabled()
    policy.set_busy(False)
    assert not policy.busy_label.isVisible()
    assert "SmolLM2-135M-Instruct" in policy.model_label.text()
    policy.set_load_progress(0.5, "loading weights")
    assert policy.load_bar.value() == 500 and policy.load_message.text() == "loading weights"


# ---------------------------------------------------------------------- the policy form, from engine.sparse.SPECS
def _shown(spec):
    return [p for p in spec.params if p.panel]


def test_every_shown_param_has_a_widget_with_the_specs_default_and_range(policy):
    from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox

    from engine.sparse import SPECS
    assert list(policy._params) == list(SPECS)
    assert [policy.policy_combo.itemText(i) for i in range(policy.policy_combo.count())] == [
        s.title for s in SPECS.values()]
    for spec in SPECS.values():
        widgets = policy._params[spec.name]
        assert list(widgets) == [p.name for p in _shown(spec)], spec.name    # hidden params stay CLI/library only
        for p in _shown(spec):
            w = widgets[p.name]
            assert p.help[1:] in w.toolTip() and (p.type is bool or p.describe_range() in w.toolTip())
            if p.choices:
                assert isinstance(w, QComboBox) and w.currentData() == p.default
                assert [w.itemData(i) for i in range(w.count())] == list(p.choices)
            elif p.type is bool:
                assert isinstance(w, QCheckBox) and w.isChecked() == p.default
            else:
                assert isinstance(w, QSpinBox if p.type is int else QDoubleSpinBox), p.name
                assert w.value() == pytest.approx(p.default)
                assert w.maximum() == pytest.approx(p.max)
                if p.min_open:                                    # (min, max]: the smallest step above min
                    assert p.min < w.minimum() <= p.min + 0.01
                else:
                    assert w.minimum() == pytest.approx(p.min)
        policy.set_config({"mode": spec.modes[0], "policy": spec.name})
        assert policy.config()["policy_params"] == {p.name: p.default for p in _shown(spec)}
        assert spec.help in policy.policy_tooltip(spec.name)
    min_len = policy._params["xattention"]["min_len"]            # 0 = auto (per device), and says so
    assert min_len.value() == 0 and min_len.text() == "auto" and "0 = auto" in min_len.toolTip()
    min_len.setValue(4096)
    assert min_len.text() == "4096" and policy._params["minference"]["min_len"].specialValueText() == ""
    vertical = policy._params["minference"]["vertical"]          # a fraction of the prompt stays representable
    vertical.setValue(0.1)
    assert vertical.value() == pytest.approx(0.1) and policy._params["xattention"]["threshold"].decimals() == 2


def test_unavailable_policies_say_why_from_the_spec(policy):
    from engine.sparse import SPECS
    for mode in ("gpu", "layerwise", "chunked"):
        policy.set_config({"mode": mode})
        for spec in SPECS.values():
            item = policy.policy_combo.model().item(policy.policy_combo.findData(spec.name))
            assert item.isEnabled() == (mode in spec.modes) == policy.policy_available(spec.name)
            tip = policy.policy_tooltip(spec.name)
            if mode not in spec.modes:
                assert tip.startswith(f"Not available in {mode} mode: ") and spec.why_not in tip
                assert all(m in tip for m in spec.modes)          # and where it does run


def _other_value(p):
    """A valid value of `p` other than its default."""
    if p.choices:
        return next(c for c in p.choices if c != p.default)
    if p.type is bool:
        return not p.default
    value = p.default + p.step if p.max is None or p.default + p.step <= p.max else p.default - p.step
    return int(value) if p.type is int else round(value, 6)


def test_config_round_trips_for_every_policy_and_bad_values_are_clamped(policy, qtbot):
    from engine.sparse import SPECS
    for spec in SPECS.values():
        cfg = {"mode": spec.modes[0], "kv_block_size": 256, "policy": spec.name,
               "policy_params": {p.name: _other_value(p) for p in _shown(spec)}}
        policy.set_config(cfg)
        params = policy.config()["policy_params"]
        assert params == cfg["policy_params"] and policy.policy() == spec.name
        spec.validate(params)
        other = PolicyPanel()
        qtbot.addWidget(other)
        other.set_config(policy.config())
        assert other.config() == policy.config()

        bad = {}                                                  # beyond each range: clamped to it
        for p in _shown(spec):
            if p.choices:
                bad[p.name] = max(p.choices) + 1                  # not a choice: the choice stays
            elif p.type is not bool:
                bad[p.name] = p.max * 10
        policy.set_config({"policy_params": bad})
        params = policy.config()["policy_params"]
        spec.validate(params)                                     # still in range: no ConfigError
        for p in _shown(spec):
            if p.choices:
                assert params[p.name] == _other_value(p)
            elif p.type is not bool:
                assert params[p.name] == p.max
        policy.set_config({"policy_params": {p.name: (p.min or 0) - 100 for p in _shown(spec)
                                             if not p.choices and p.type is not bool}})
        spec.validate(policy.config()["policy_params"])           # clamped up to the minimum, open or not


def test_a_typed_value_beyond_the_range_is_not_accepted(policy, qtbot):
    policy.set_config({"mode": "layerwise", "policy": "quest"})
    box = policy._params["quest"]["token_budget"]
    box.selectAll()
    qtbot.keyClicks(box, "999999999")                              # more digits than the range allows
    qtbot.keyClick(box, Qt.Key.Key_Return)
    before = box.value()
    assert 32 <= before <= 4194304
    box.selectAll()
    qtbot.keyClicks(box, "5")                                      # below the minimum: not taken
    qtbot.keyClick(box, Qt.Key.Key_Return)
    box.clearFocus()
    assert box.value() == before and policy.config()["policy_params"]["token_budget"] == before
