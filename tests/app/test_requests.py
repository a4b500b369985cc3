"""The window's bookkeeping of the requests it sent its worker (app/requests.py), as the worker's signals drive it."""
from app.requests import Requests


def test_stop_pressed_during_a_model_load_stops_the_question_queued_behind_it():
    r = Requests()
    r.add("load")
    r.add("ask")
    assert not r.begin()                 # the load begins
    r.stop_pressed()                     # Stop while the model loads: the question has not begun
    assert r.finish() == "load"
    assert r.begin()                     # the question begins: stop it at once
    assert r.finish() == "ask" and not r


def test_stop_pressed_during_an_answer_leaves_the_next_question_alone():
    r = Requests()
    r.add("ask")
    r.begin()
    r.stop_pressed()                     # the running answer is the worker's to stop
    r.add("ask")
    assert r.finish() == "ask"
    assert not r.begin()                 # the next question runs
    assert r.head == "ask" and "ask" in r


def test_a_refused_question_leaves_nothing_behind():
    r = Requests()
    r.add("ask")
    r.stop_pressed()
    assert r.head == "ask" and not r.started
    assert r.finish() == "ask"           # refused before it began: no busy signals come
    r.add("ask")
    assert not r.begin()                 # a Stop meant for the refused question does not stop the next one
