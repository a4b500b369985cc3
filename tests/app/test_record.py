"""What a conversation's recording keeps (app/record.py)."""
import numpy as np

from app.record import Conversation
from tests.engine.test_compare import decode


def test_a_conversation_keeps_the_steps_of_its_last_turns_and_numbers_them_on_after_a_reload():
    conv = Conversation(keep_steps=2)
    for i in range(4):                      # a reloaded engine numbers its steps from 0 again every turn
        conv.end_turn(f"q{i}", f"a{i}", {}, {"policy": "full"}, [decode(0, np.array([[[1]]])), decode(1, np.array([[[2]]]))])
    assert [bool(t["steps"]) for t in conv.turns] == [False, False, True, True]
    assert conv.turns[0]["steps_dropped"] and conv.turns[0]["answer"] == "a0"
    rec = conv.recording("doc", {})
    assert [(t["first_step"], t["last_step"]) for t in rec.turns] == [(0, -1), (0, -1), (0, 1), (2, 3)]
    assert [s.step for s in rec.steps] == [0, 1, 2, 3] and [len(rec.turn_steps(i)) for i in range(4)] == [0, 0, 2, 2]
