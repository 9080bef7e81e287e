"""Generate the chat recipe's dataset: arithmetic questions answered as JSON, one to three turns per conversation.

    python configs/data/make_chat.py > configs/data/chat_json.jsonl

SmolLM2-135M-Instruct answers "What is 12 + 7?" in prose ("12 + 7 = 19"); after the LoRA fine-tune of
configs/smollm2-chat-lora.yaml it answers ``{"answer": 19}``: a change anyone can see in the run's summary.
A third of the conversations have several turns, so learning every assistant turn (data.train_on=all_assistant)
is exercised. Deterministic (fixed seed), so the committed file can be checked against this script.
"""

import json
import random
import sys

QUESTIONS = {
    "+": ["What is {a} + {b}?", "Add {a} and {b}.", "What do you get when you add {a} to {b}?", "{a} plus {b}?"],
    "-": ["What is {a} - {b}?", "Subtract {b} from {a}.", "What is {a} minus {b}?", "Take {b} away from {a}."],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} * {b}?", "What's the product of {a} and {b}?"],
}
FOLLOW_UPS = ["And {a} + {b}?", "Now {a} - {b}?", "What about {a} times {b}?"]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
FOLLOW_OPS = ["+", "-", "*"]


def turn(rng: random.Random, follow_up: bool) -> tuple[str, str]:
    """One question and its JSON answer."""
    if follow_up:
        i = rng.randrange(len(FOLLOW_UPS))
        template, op = FOLLOW_UPS[i], FOLLOW_OPS[i]
    else:
        op = rng.choice(list(OPS))
        template = rng.choice(QUESTIONS[op])
    a, b = rng.randint(2, 99), rng.randint(2, 12 if op == "*" else 99)
    if op == "-" and b > a:
        a, b = b, a
    return template.format(a=a, b=b), json.dumps({"answer": OPS[op](a, b)})


def records(n: int = 600, seed: int = 7):
    rng = random.Random(seed)
    for _ in range(n):
        messages = []
        for k in range(rng.choice([1, 1, 2, 3])):
            question, answer = turn(rng, follow_up=k > 0)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        yield {"messages": messages}


if __name__ == "__main__":
    for rec in records():
        sys.stdout.write(json.dumps(rec) + "\n")
