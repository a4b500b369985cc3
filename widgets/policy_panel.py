"""Engine settings: the model, the execution mode and its knobs, and the sparse-attention policy.

A pure view. `config()` returns engine keyword arguments (only the knobs that apply to the chosen mode) plus
{"policy": name, "policy_params": {...}}; `config_changed(dict)` fires when the user changes something.
Combinations that cannot work are disabled, and their tooltip says why.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget)

from engine.sparse.specs import SPECS, PolicySpec   # torch-free: what each policy takes
from widgets.policy_form import PolicyForm, combo_box, spin_box

MODES = {
    "gpu": "All KV on the GPU: fastest; the context is bounded by GPU memory.",
    "layerwise": "KV in a pinned host pool; decode streams whole layers through a ring of GPU buffers. "
                 "Prefill is as fast as gpu mode; decode is bound by host-to-GPU bandwidth.",
    "chunked": "KV in host memory; prefill and decode go block by block through all layers, re-reading "
               "earlier blocks: smallest GPU footprint, most host-to-GPU traffic.",
}
OFFLOAD_MODES = ("layerwise", "chunked")


def _why_not(spec: PolicySpec) -> str:
    if not spec.why_not:
        return ""
    return f"{spec.title} runs in {' or '.join(spec.modes)} mode only: {spec.why_not}."


# key: (shown name, modes it works in, what it does, why it is unavailable elsewhere), from engine.sparse.SPECS
POLICIES = {name: (spec.title, tuple(spec.modes), spec.help, _why_not(spec)) for name, spec in SPECS.items()}
BLOCK_SIZES = [2**i for i in range(4, 13)]   # 16 .. 4096
DEFAULT_MODEL = "default: SmolLM2-135M-Instruct"
BUSY_TEXT = "A turn is running: changes apply at the next turn."


def _dspin(lo: float, hi: float, value: float, step: float, decimals: int, tip: str = "",
           suffix: str = "") -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=lo, maximum=hi, value=value, singleStep=step, decimals=decimals, suffix=suffix)
    box.setToolTip(tip)
    return box


class PolicyPanel(QWidget):
    """Model picker with load progress, execution mode with its knobs, and sparse policy with its parameters."""

    config_changed = Signal(dict)
    model_folder_chosen = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._quiet = 0               # > 0 while set_config / internal updates run: no config_changed
        self._last_emitted: dict | None = None
        self._tips: dict[QWidget, str] = {}   # each knob's own explanation, before any "disabled because"
        self._engine_policies = set(POLICIES)  # narrowed by set_engine_policies()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._build_model_box())
        layout.addWidget(self._build_mode_box())
        layout.addWidget(self._build_policy_box())
        self.busy_label = QLabel(BUSY_TEXT)
        self.busy_label.setWordWrap(True)
        italic = self.busy_label.font()
        italic.setItalic(True)
        self.busy_label.setFont(italic)
        policy = self.busy_label.sizePolicy()
        policy.setRetainSizeWhenHidden(True)   # shown for each turn: keeping its place moves no knob above it
        self.busy_label.setSizePolicy(policy)
        self.busy_label.hide()
        self.note_label = QLabel()    # e.g. "Quest isn't available in gpu mode: switched to Full"
        self.note_label.setWordWrap(True)
        self.note_label.hide()
        layout.addWidget(self.note_label)
        layout.addWidget(self.busy_label)
        layout.addStretch(1)
        self._update_availability()
        self._last_emitted = self.config()

    # ------------------------------------------------------------------ building
    def _build_model_box(self) -> QGroupBox:
        box = QGroupBox("Model")
        self.model_label = QLabel(DEFAULT_MODEL)
        self.model_label.setWordWrap(True)
        self.model_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.choose_button = QPushButton("Choose folder…")
        self.choose_button.setToolTip("Use a Hugging Face model folder (config.json, safetensors weights and "
                                      "tokenizer files) instead of the embedded default model.")
        self.choose_button.clicked.connect(self._choose_folder)
        self.load_bar = QProgressBar(minimum=0, maximum=1000, value=0)
        self.load_bar.setTextVisible(False)
        self.load_bar.hide()          # shown while a model loads
        self.load_message = QLabel()
        self.load_message.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.model_label, 1)
        row.addWidget(self.choose_button)
        col = QVBoxLayout(box)
        col.addLayout(row)
        col.addWidget(self.load_bar)
        col.addWidget(self.load_message)
        return box

    def _build_mode_box(self) -> QGroupBox:
        box = QGroupBox("Execution")
        form = QFormLayout(box)
        self.mode_combo = QComboBox()
        for i, (mode, tip) in enumerate(MODES.items()):
            self.mode_combo.addItem(mode, mode)
            self.mode_combo.setItemData(i, tip, Qt.ItemDataRole.ToolTipRole)
        self.ring_slots = spin_box(1, 8, 3, tip="Device buffers in the ring: whole layers (layerwise) or blocks "
                                   "(chunked). More slots hide more copy latency and cost device memory; 2-4 "
                                   "is usually enough.")
        self.budget_check = QCheckBox("limit")
        self.budget_gb = _dspin(0.1, 1024.0, 4.0, 0.5, 1, suffix=" GB",
                                tip="Device memory for KV in layerwise mode: as many layers as fit stay resident "
                                    "on the GPU, the rest stream from the host. Unchecked: all layers stream.")
        self.host_check = QCheckBox("limit")
        self.host_gb = _dspin(0.5, 4096.0, 16.0, 1.0, 1, suffix=" GB",
                              tip="Size of the pinned host KV pool. Unchecked: enough for one sequence of the "
                                  "model's context length. A pool larger than free RAM is refused.")
        self.block_size = combo_box(BLOCK_SIZES, 256, "Tokens per KV block (16-4096, powers of two): the prefix "
                                    "cache's granularity, and in chunked mode also the chunk size. Larger blocks "
                                    "mean fewer, bigger copies; 256 is a good default.")
        self.prefill_chunk = spin_box(0, 1048576, 0, 1024, tip="Layerwise prefill: prompt rows per "
                                      "QKV/MLP chunk. Bounds activation memory on long prompts. auto: as many as "
                                      "keep the MLP's activations under 256 MiB, at least 8192.")
        self.prefill_chunk.setSpecialValueText("auto")
        self._budget_row = self._with_check(self.budget_check, self.budget_gb)
        self._host_row = self._with_check(self.host_check, self.host_gb)
        form.addRow("Mode", self.mode_combo)
        form.addRow("Ring slots", self.ring_slots)
        form.addRow("GPU KV budget", self._budget_row)
        form.addRow("Host KV pool", self._host_row)
        form.addRow("Block size", self.block_size)
        form.addRow("Prefill chunk", self.prefill_chunk)
        self.mode_combo.currentIndexChanged.connect(self._on_mode_changed)
        self.budget_check.toggled.connect(self.budget_gb.setEnabled)
        self.host_check.toggled.connect(self.host_gb.setEnabled)
        for w in (self.ring_slots, self.budget_gb, self.host_gb, self.prefill_chunk):
            w.valueChanged.connect(self._changed)
        for w in (self.budget_check, self.host_check):
            w.toggled.connect(self._changed)
        self.block_size.currentIndexChanged.connect(self._changed)
        return box

    def _with_check(self, check: QCheckBox, box: QWidget) -> QWidget:
        row = QWidget()
        lay = QHBoxLayout(row)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(check)
        lay.addWidget(box, 1)
        box.setEnabled(False)
        check.setToolTip(box.toolTip())
        row.setToolTip(box.toolTip())
        return row

    def _build_policy_box(self) -> QGroupBox:
        box = QGroupBox("Sparse attention policy")
        form = QFormLayout(box)
        self.policy_combo = QComboBox()
        for key, spec in SPECS.items():
            self.policy_combo.addItem(spec.title, key)
        self.policy_combo.currentIndexChanged.connect(self._on_policy_changed)
        self.params_stack = PolicyForm()                      # one page per policy, in the combo's order
        self.params_stack.changed.connect(self._changed)
        self._params = self.params_stack.editors              # policy -> shown parameter -> its editor
        form.addRow("Policy", self.policy_combo)
        form.addRow(self.params_stack)
        return box

    # ------------------------------------------------------------------ availability
    def mode(self) -> str:
        return self.mode_combo.currentData()

    def policy(self) -> str:
        return self.policy_combo.currentData()

    def policy_available(self, policy: str, mode: str | None = None) -> bool:
        """Whether `policy` works in `mode` (default: the chosen mode) and the engine has it."""
        return (mode or self.mode()) in POLICIES[policy][1] and policy in self._engine_policies

    def set_engine_policies(self, names) -> None:
        """The policies the running engine implements (engine.POLICIES); the others are disabled and say so."""
        self._engine_policies = set(names)
        self._update_availability()

    def policy_tooltip(self, policy: str) -> str:
        """The tooltip of `policy`'s entry in the chooser (says why when it is disabled)."""
        index = self.policy_combo.findData(policy)
        return self.policy_combo.itemData(index, Qt.ItemDataRole.ToolTipRole) or ""

    def _set_available(self, widgets: list[QWidget], ok: bool, why: str) -> None:
        for w in widgets:
            tip = self._tips.setdefault(w, w.toolTip())
            w.setEnabled(ok)
            w.setToolTip(tip if ok else f"Disabled: {why}\n\n{tip}")

    def _update_availability(self) -> None:
        """Enable the knobs and policies that apply to the chosen mode; the others say why they don't."""
        mode = self.mode()
        offload = mode in OFFLOAD_MODES
        self._set_available([self.ring_slots], offload, "ring slots only apply in the offload modes "
                            "(layerwise, chunked); in gpu mode all KV stays on the GPU.")
        self._set_available([self._budget_row, self.budget_check, self.budget_gb], mode == "layerwise",
                            "the GPU KV budget applies in layerwise mode only (it decides which whole layers "
                            "stay resident).")
        self.budget_gb.setEnabled(mode == "layerwise" and self.budget_check.isChecked())
        self._set_available([self._host_row, self.host_check, self.host_gb], offload,
                            "the host KV pool exists only in the offload modes (layerwise, chunked).")
        self.host_gb.setEnabled(offload and self.host_check.isChecked())
        self._set_available([self.prefill_chunk], mode == "layerwise",
                            "prefill chunking applies to layerwise prefill only (gpu mode prefills in "
                            "batches, chunked mode one block at a time).")
        model = self.policy_combo.model()
        assert isinstance(model, QStandardItemModel)
        for key, (name, modes, tip, why) in POLICIES.items():
            item = model.item(self.policy_combo.findData(key))
            ok = mode in modes
            if key not in self._engine_policies:
                have = ", ".join(sorted(self._engine_policies))
                ok, why = False, f"{name} is not in the running engine (it has {have})."
            item.setEnabled(ok)
            item.setToolTip(tip if ok else f"Not available in {mode} mode: {why}\n\n{tip}")
        self.policy_combo.setToolTip(self.policy_tooltip(self.policy()))
        if not self.policy_available(self.policy()):
            name, _modes, _tip, why = POLICIES[self.policy()]
            self.policy_combo.setCurrentIndex(self.policy_combo.findData("full"))
            self.note_label.setText(f"{name} does not run in {mode} mode, so the policy is now Full "
                                    "(the policy list's tooltips say why).")
            self.note_label.setToolTip(why)
            self.note_label.show()

    # ------------------------------------------------------------------ changes
    def _on_mode_changed(self) -> None:
        self.note_label.hide()
        self._quiet += 1
        try:
            self._update_availability()
        finally:
            self._quiet -= 1
        self._changed()

    def _on_policy_changed(self) -> None:
        self.params_stack.setCurrentIndex(self.policy_combo.currentIndex())
        self.policy_combo.setToolTip(self.policy_tooltip(self.policy()))
        if self.policy() != "full":
            self.note_label.hide()
        self._changed()

    def _changed(self, *_) -> None:
        if self._quiet:
            return
        config = self.config()
        if config != self._last_emitted:
            self._last_emitted = config
            self.config_changed.emit(config)

    # ------------------------------------------------------------------ config
    def config(self) -> dict:
        """Engine keyword args for the chosen mode, plus "policy" and "policy_params"."""
        mode = self.mode()
        cfg: dict = {"mode": mode, "kv_block_size": self.block_size.currentData()}
        if mode in OFFLOAD_MODES:
            cfg["ring_slots"] = self.ring_slots.value()
            if self.host_check.isChecked():
                cfg["host_kv_gb"] = self.host_gb.value()
        if mode == "layerwise":
            cfg["prefill_chunk_tokens"] = self.prefill_chunk.value() or None   # 0: auto
            if self.budget_check.isChecked():
                cfg["gpu_kv_budget_gb"] = self.budget_gb.value()
        params = self.params_stack.values(self.policy())   # shown ones only
        cfg.update(policy=self.policy(), policy_params=params)
        return cfg

    def set_config(self, config: dict) -> None:
        """Show `config` (as `config()` returns it; missing keys keep their values). Does not emit
        config_changed. A policy the mode cannot run falls back to Full, with a note saying why."""
        self._quiet += 1
        try:
            if "mode" in config:
                self.mode_combo.setCurrentIndex(max(0, self.mode_combo.findData(config["mode"])))
            if "ring_slots" in config:
                self.ring_slots.setValue(int(config["ring_slots"]))
            if "kv_block_size" in config:
                self.block_size.setCurrentIndex(max(0, self.block_size.findData(int(config["kv_block_size"]))))
            if "prefill_chunk_tokens" in config:
                self.prefill_chunk.setValue(int(config["prefill_chunk_tokens"] or 0))
            for key, check, box in (("gpu_kv_budget_gb", self.budget_check, self.budget_gb),
                                    ("host_kv_gb", self.host_check, self.host_gb)):
                if key in config:
                    check.setChecked(config[key] is not None)
                    if config[key] is not None:
                        box.setValue(float(config[key]))
            if "policy" in config:
                self.policy_combo.setCurrentIndex(max(0, self.policy_combo.findData(config["policy"])))
            # a hidden parameter keeps the engine's default
            self.params_stack.set_values(self.policy(), config.get("policy_params") or {})
            self._update_availability()
        finally:
            self._quiet -= 1
        self._last_emitted = self.config()

    # ------------------------------------------------------------------ model and status
    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder")
        if folder:
            self.model_folder_chosen.emit(folder)

    def set_model_label(self, text: str) -> None:
        """The line naming the model, e.g. the folder's name once it loaded."""
        self.model_label.setText(text or DEFAULT_MODEL)

    def set_load_progress(self, fraction: float | None, message: str = "") -> None:
        """Model loading progress in [0, 1] (None = busy, length unknown) and what is happening.
        The bar shows while loading and hides at 1.0; the message stays."""
        self.load_bar.setVisible(fraction is None or fraction < 1.0)
        if fraction is None:
            self.load_bar.setRange(0, 0)
        else:
            self.load_bar.setRange(0, 1000)
            self.load_bar.setValue(int(round(1000 * min(1.0, max(0.0, fraction)))))
        self.load_message.setText(message)

    def set_busy(self, busy: bool) -> None:
        """While a turn runs, say that changes apply at the next turn (the controls stay usable)."""
        self.busy_label.setVisible(busy)
