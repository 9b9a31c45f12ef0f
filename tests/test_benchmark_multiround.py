"""The multi-round document QA workload of bench.peers: what it asks, in what order."""

from bench.multiround import Workload


def small() -> Workload:
    return Workload(num_documents=3, document_words=50, num_rounds=2, system_words=10, question_words=4)


def test_every_round_visits_every_document_once():
    requests = small().requests()
    assert len(requests) == 6
    for round_index in range(2):
        assert sorted(doc for doc, r, _ in requests if r == round_index) == [0, 1, 2]


def test_a_round_extends_the_prompt_of_the_round_before():
    w = small()
    assert w.prompt(1, 1).startswith(w.prompt(1, 0) + " ")
    assert w.prompt(0, 0).split()[:10] == w.prompt(2, 0).split()[:10]  # the shared system prompt
    assert w.prompt(0, 0) != w.prompt(2, 0)
