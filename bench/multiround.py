"""A multi-round long-document QA workload, driven concurrently against one engine.

Many users ask questions about a set of long documents, all behind one shared system prompt.
Each round asks one new question about every document, in a new order, and a request carries the
document and every question asked about it so far (the chat so far), so round r reuses the whole
prompt of round r-1. With more documents than the engine's own KV cache holds, a document comes
back after its KV was evicted from the engine: what it costs then is what a KV cache tier is for.

`Workload.requests` lists the (document, round, prompt) triples in the order sent; `drive` sends
them from `num_users` concurrent users through any `complete(prompt, max_tokens)` callable and
returns one `Outcome` per request plus the wall time. Nothing here knows which engine it drives.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpkv.demo.model import prompt_text


@dataclass(frozen=True)
class Workload:
    num_documents: int = 24
    document_words: int = 4000
    num_rounds: int = 3
    system_words: int = 200
    question_words: int = 24
    seed: int = 7_000

    def system_prompt(self) -> str:
        return prompt_text(self.system_words, seed=self.seed)

    def document(self, doc: int) -> str:
        return prompt_text(self.document_words, seed=self.seed + 1 + doc)

    def question(self, doc: int, round_index: int) -> str:
        return prompt_text(self.question_words, seed=self.seed + 100_000 + 1_000 * doc + round_index)

    def prompt(self, doc: int, round_index: int) -> str:
        turns = " ".join(self.question(doc, r) for r in range(round_index + 1))
        return f"{self.system_prompt()} {self.document(doc)} {turns}"

    def requests(self) -> list[tuple[int, int, str]]:
        """Every round visits every document once, in an order of its own (seeded)."""
        rng = random.Random(self.seed)
        out = []
        for round_index in range(self.num_rounds):
            docs = list(range(self.num_documents))
            rng.shuffle(docs)
            out += [(doc, round_index, self.prompt(doc, round_index)) for doc in docs]
        return out


@dataclass
class Outcome:
    doc: int
    round_index: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    token_ids: list[int] | None


def drive(
    requests: list[tuple[int, int, str]], complete: Callable, num_users: int, max_tokens: int
) -> tuple[list[Outcome], float]:
    """Users take the next request from one shared queue as soon as their last one is answered,
    so `num_users` requests are in flight until the queue runs dry. Returns (outcomes in the
    order of `requests`, wall seconds)."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def user() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or errors:
                return
            doc, round_index, prompt = requests[i]
            try:
                c = complete(prompt, max_tokens)
            except BaseException as exc:  # reported once every user has stopped
                errors.append(exc)
                return
            outcomes[i] = Outcome(doc, round_index, c.ttft_s, c.total_s, c.prompt_tokens, c.token_ids)

    started = time.perf_counter()
    threads = [threading.Thread(target=user) for _ in range(num_users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outcomes, time.perf_counter() - started
