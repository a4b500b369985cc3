"""Engine settings: the model, the execution mode and its knobs, and the sparse-attention policy.

A pure view. `config()` returns engine keyword arguments (only the knobs that apply to the chosen mode) plus
{"policy": name, "policy_params": {...}}; `config_changed(dict)` fires when the user changes something.
Combinations that cannot work are disabled, and their tooltip says why.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QProgressBar, QPushButton, QSpinBox, QStackedWidget,
                               QVBoxLayout, QWidget)

MODES = {
    "gpu": "All KV on the GPU: fastest; the context is bounded by GPU memory.",
    "layerwise": "KV in a pinned host pool; decode streams whole layers through a ring of GPU buffers. "
                 "Prefill is as fast as gpu mode; decode is bound by host-to-GPU bandwidth.",
    "chunked": "KV in host memory; prefill and decode go block by block through all layers, re-reading "
               "earlier blocks: smallest GPU footprint, most host-to-GPU traffic.",
}
OFFLOAD_MODES = ("layerwise", "chunked")
POLICIES = {   # key: (shown name, modes it works in, what it does, why it is unavailable elsewhere)
    "full": ("Full", ("gpu", "layerwise", "chunked"), "Dense attention over every token: the exact baseline.", ""),
    "quest": ("Quest", ("layerwise", "chunked"),
              "Decode policy: per step, loads only the KV pages whose key bounds promise the highest attention "
              "scores for the current query (less host-to-GPU traffic).",
              "Quest chooses which host KV pages to load at each decode step of an offload mode. In gpu mode all "
              "KV is already on the GPU: choose layerwise or chunked."),
    "minference": ("MInference", ("gpu", "layerwise"),
                   "Prefill policy: attends to a few vertical lines (key columns) and slash lines (diagonals) "
                   "estimated from the last queries, skipping the rest of the attention matrix.",
                   "MInference is a prefill policy that needs a layer's whole prompt at once; chunked mode "
                   "prefills block by block: choose gpu or layerwise."),
    "xattention": ("XAttention", ("gpu", "layerwise"),
                   "Prefill policy: scores attention blocks by the sums of their antidiagonals and computes only "
                   "the blocks needed to reach the threshold of attention mass.",
                   "XAttention is a prefill policy that needs a layer's whole prompt at once; chunked mode "
                   "prefills block by block: choose gpu or layerwise."),
}
BLOCK_SIZES = [2**i for i in range(4, 13)]   # 16 .. 4096
QUEST_PAGE_SIZES = [16, 32, 64]
XATTENTION_STRIDES = [4, 8, 16, 32, 64]      # divisors of XAttention's 128-token block
DENSE_BELOW_TIP = ("Prompts (keys of a layer) shorter than this many tokens use dense prefill: sparsity only pays "
                   "off on long prompts.")
DEFAULT_MODEL = "default: SmolLM2-135M-Instruct"
BUSY_TEXT = "A turn is running: changes apply at the next turn."


def _spin(lo: int, hi: int, value: int, step: int = 1, tip: str = "", suffix: str = "") -> QSpinBox:
    box = QSpinBox(minimum=lo, maximum=hi, value=value, singleStep=step, suffix=suffix)
    box.setToolTip(tip)
    return box


def _dspin(lo: float, hi: float, value: float, step: float, decimals: int, tip: str = "",
           suffix: str = "") -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=lo, maximum=hi, value=value, singleStep=step, decimals=decimals, suffix=suffix)
    box.setToolTip(tip)
    return box


def _combo(values: list[int], value: int, tip: str) -> QComboBox:
    box = QComboBox()
    for v in values:
        box.addItem(str(v), v)
    box.setCurrentIndex(values.index(value))
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
        self.ring_slots = _spin(1, 8, 3, tip="Device buffers in the ring: whole layers (layerwise) or blocks "
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
        self.block_size = _combo(BLOCK_SIZES, 256, "Tokens per KV block (16-4096, powers of two): the prefix "
                                 "cache's granularity, and in chunked mode also the chunk size. Larger blocks "
                                 "mean fewer, bigger copies; 256 is a good default.")
        self.prefill_chunk = _spin(256, 1048576, 8192, 1024, tip="Layerwise prefill: prompt rows per QKV/MLP "
                                   "chunk. Bounds activation memory on long prompts; 4096-16384 is typical.")
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
        for key, (name, _modes, tip, _why) in POLICIES.items():
            self.policy_combo.addItem(name, key)
        self.policy_combo.currentIndexChanged.connect(self._on_policy_changed)
        self.params_stack = QStackedWidget()
        self._params: dict[str, dict[str, QWidget]] = {
            "full": {},
            "quest": {
                "token_budget": _spin(256, 65536, 2048, 256, tip="KV tokens loaded per decode step and head "
                                      "(rounded to pages). Smaller = faster, less exact; 1024-4096 is typical."),
                "page_size": _combo(QUEST_PAGE_SIZES, 16, "Tokens per Quest page, the unit whose key min/max "
                                    "bounds are scored. Smaller pages select more precisely, cost more metadata."),
                "dense_layers": _spin(0, 8, 2, tip="The first layers attend densely (their attention is spread "
                                      "out, so page selection hurts them most). 2 is the usual choice."),
            },
            "minference": {
                "vertical": _dspin(0.01, 1048576, 1000, 100, 2, tip="Key columns (vertical lines) every query "
                                   "attends to, picked from the last 64 queries' scores (the first 64 always): a "
                                   "count, or a fraction of the prompt if at most 1. Typical 500-2000."),
                "slash": _dspin(0.01, 1048576, 6096, 256, 2, tip="Diagonals (slash lines: fixed query-key "
                                "distances) every query attends to (the nearest 128 always): a count, or a "
                                "fraction of the prompt if at most 1. Typical 2000-8000."),
                "min_len": _spin(1, 1048576, 8192, 1024, tip=DENSE_BELOW_TIP),
            },
            "xattention": {
                "threshold": _dspin(0.01, 1.0, 0.9, 0.05, 2, tip="Tau: keep the highest-scoring key blocks of "
                                    "each query block until they hold this share of the attention mass. Higher = "
                                    "more exact, slower; 0.8-0.95 is typical."),
                "stride": _combo(XATTENTION_STRIDES, 16, "Antidiagonal stride used to score the 128-token "
                                 "blocks (it divides the block): larger is cheaper to score and coarser. 8 or 16 "
                                 "is typical."),
                "min_len": _spin(1, 1048576, 8192, 1024, tip=DENSE_BELOW_TIP),
            },
        }
        labels = {"token_budget": "Token budget", "page_size": "Page size", "dense_layers": "Dense layers",
                  "vertical": "Vertical lines", "slash": "Slash lines", "min_len": "Dense below (tokens)",
                  "threshold": "Threshold τ", "stride": "Stride"}
        for key, params in self._params.items():
            page = QWidget()
            page_form = QFormLayout(page)
            page_form.setContentsMargins(0, 0, 0, 0)
            if not params:
                page_form.addRow(QLabel("No parameters: every token is attended to."))
            for name, w in params.items():
                page_form.addRow(labels[name], w)
                signal = w.currentIndexChanged if isinstance(w, QComboBox) else w.valueChanged
                signal.connect(self._changed)
            self.params_stack.addWidget(page)
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
            cfg["prefill_chunk_tokens"] = self.prefill_chunk.value()
            if self.budget_check.isChecked():
                cfg["gpu_kv_budget_gb"] = self.budget_gb.value()
        params = {name: (w.currentData() if isinstance(w, QComboBox) else w.value())
                  for name, w in self._params[self.policy()].items()}
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
                self.prefill_chunk.setValue(int(config["prefill_chunk_tokens"]))
            for key, check, box in (("gpu_kv_budget_gb", self.budget_check, self.budget_gb),
                                    ("host_kv_gb", self.host_check, self.host_gb)):
                if key in config:
                    check.setChecked(config[key] is not None)
                    if config[key] is not None:
                        box.setValue(float(config[key]))
            if "policy" in config:
                self.policy_combo.setCurrentIndex(max(0, self.policy_combo.findData(config["policy"])))
            params = self._params[self.policy()]
            for name, value in (config.get("policy_params") or {}).items():
                w = params.get(name)
                if isinstance(w, QComboBox):
                    w.setCurrentIndex(max(0, w.findData(value)))
                elif w is not None:
                    w.setValue(value)
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
