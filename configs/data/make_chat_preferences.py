"""Generate the real model's preference pairs: the chat recipe's conversations (make_chat.py), the final answer as
JSON chosen over the same answer in prose.

    python configs/data/make_chat_preferences.py > configs/data/chat_preferences.jsonl

SmolLM2-135M-Instruct answers in prose; DPO (configs/smollm2-chat-dpo.yaml) teaches it to prefer the JSON answer
over the prose one that says the same number. Deterministic: the conversations are make_chat.py's.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from make_chat import records  # noqa: E402 -- this folder's script, beside this one


def preferences():
    for rec in records():
        *prompt, last = rec["messages"]
        answer = json.loads(last["content"])["answer"]
        yield {
            "prompt": prompt,
            "chosen": [last],
            "rejected": [{"role": "assistant", "content": f"The answer is {answer}."}],
        }


if __name__ == "__main__":
    for rec in preferences():
        sys.stdout.write(json.dumps(rec) + "\n")
