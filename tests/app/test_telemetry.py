"""The telemetry pump: it coalesces the engine's steps, never drops one, and draws less often when drawing costs
more of the GUI thread than its budget (the engine needs those cycles on a small CPU)."""
import time
from types import SimpleNamespace

from app import telemetry
from app.telemetry import CPU_BUDGET, TIGHT_BUDGET, TelemetryPump, gui_budget


def test_the_budget_is_tight_only_where_the_engine_needs_what_the_gui_takes():
    assert gui_budget("cpu", 2, "layerwise", cores=2) == CPU_BUDGET
    assert gui_budget("cpu", 3, "gpu", cores=4) == 1.0             # a core to spare
    assert gui_budget("cuda:0", 16, "gpu", cores=16) == 1.0        # one graph replay per step
    assert gui_budget("cuda:0", 16, "layerwise", cores=16) == TIGHT_BUDGET   # a Python loop per step: the GIL
    assert gui_budget("cuda:0", 16, "chunked", cores=16) == TIGHT_BUDGET


def _pump(cost_s: float, budget: float):
    numbers = iter(range(10**6))
    drawn = []

    def draw(steps, recent):
        t = time.thread_time()
        while time.thread_time() - t < cost_s:           # a draw that costs GUI-thread CPU
            pass
        drawn.extend(s.step for s in steps)
    pump = TelemetryPump(lambda: [SimpleNamespace(step=next(numbers))], (), draw, lambda: None)
    pump.set_budget(budget)
    return pump, drawn


def test_costly_draws_are_spaced_out_and_no_step_is_lost(qapp, monkeypatch):
    monkeypatch.setattr(telemetry, "ADJUST_S", 0.1)
    pump, drawn = _pump(cost_s=0.01, budget=0.05)       # 10 ms a draw, 5% of a core: at most ~5 draws a second
    for _ in range(150):
        pump.tick()
        time.sleep(0.005)
    pump.flush()
    assert pump.interval_ms >= 4 * telemetry.TICK_MS                 # (settles at 8x: 10 ms / 264 ms < 5%)
    assert drawn == list(range(len(drawn))) and len(drawn) > 150       # every drained step, in order, once
    stats = pump.stats()
    assert stats["draws"] < 60 and stats["steps"] == len(drawn)


def test_without_a_budget_every_tick_with_steps_draws(qapp):
    pump, drawn = _pump(cost_s=0.0, budget=1.0)
    for _ in range(20):
        pump.tick()
        time.sleep(telemetry.TICK_MS / 1000)
    assert pump.interval_ms == telemetry.TICK_MS and pump.stats()["draws"] == 20 and len(drawn) >= 20


def test_the_interval_learned_in_a_turn_carries_over_the_idle_time_between_turns(qapp, monkeypatch):
    monkeypatch.setattr(telemetry, "ADJUST_S", 0.05)
    pump, drawn = _pump(cost_s=0.01, budget=0.05)
    for _ in range(60):
        pump.tick()
        time.sleep(0.005)
    learned = pump.interval_ms
    assert learned >= 4 * telemetry.TICK_MS
    pump._drain = lambda: []                             # between turns: nothing arrives, the GUI idles
    for _ in range(250):                                 # (several of the budget's windows)
        pump.tick()
        time.sleep(0.005)
    assert pump.interval_ms >= learned                   # (the draw of what was pending may still raise it)


def test_under_a_budget_the_timer_wakes_only_as_often_as_draws_can_come(qapp, monkeypatch):
    """Each tick wakes the GUI thread (on a 2-core CPU it takes a time slice from the engine): under a budget the timer
    ticks at half the draw interval (at most MAX_TICK_MS apart); without one, every TICK_MS."""
    monkeypatch.setattr(telemetry, "ADJUST_S", 0.05)
    pump, _ = _pump(cost_s=0.01, budget=0.05)
    assert pump.timer.interval() == telemetry.TICK_MS
    for _ in range(60):
        pump.tick()
        time.sleep(0.005)
    assert pump.interval_ms >= 4 * telemetry.TICK_MS
    assert pump.timer.interval() == min(telemetry.MAX_TICK_MS, int(pump.interval_ms / 2))
    pump.set_budget(1.0)
    assert pump.timer.interval() == telemetry.TICK_MS and pump.interval_ms == telemetry.TICK_MS


def test_with_nothing_arriving_the_timer_idles_until_steps_come_or_a_request_begins(qapp, monkeypatch):
    """Between turns (or in a turn not watched) every tick wakes the GUI thread for nothing: after IDLE_S without a
    step the timer ticks every IDLE_TICK_MS, under a budget or not; a step, or `wake()` (a request begins), brings the
    working rate back, and no step waits for the idle tick after that."""
    monkeypatch.setattr(telemetry, "IDLE_S", 0.05)
    for budget in (1.0, 0.05):
        pump, drawn = _pump(cost_s=0.0, budget=budget)
        working = pump.timer.interval()
        steps = pump._drain
        pump._drain = lambda: []
        for _ in range(3):
            pump.tick()
            time.sleep(0.03)
        assert pump.idle and pump.timer.interval() == telemetry.IDLE_TICK_MS
        pump._drain = steps                                # a watched turn's steps
        pump.tick()
        assert not pump.idle and pump.timer.interval() == working
        pump._drain = lambda: []
        for _ in range(3):
            pump.tick()
            time.sleep(0.03)
        assert pump.idle
        pump.wake()
        assert not pump.idle and pump.timer.interval() == working
        pump.flush()
        assert drawn == list(range(len(drawn))) and drawn                 # (the steps that came were all drawn)
