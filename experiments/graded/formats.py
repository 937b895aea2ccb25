"""The probe that chose the graded testbed's prompt wording and temperature, before the task
existed: 16 questions x 4 samples per kind of question, 48 tokens, SmolLM2-135M-Instruct, for three
wordings at one temperature; prints how many samples finish the answer sentence with the right
number (strict) and how many hold the number anywhere (lenient).

    python experiments/graded/formats.py 0.7
"""

import random
import re
import sys

import torch
from hydra import compose, initialize_config_module

from rlkit.config import build
from rlkit.engines.kv_cache import generate
from rlkit.tasks.graded import ANSWER

WORDINGS = {
    "finish": 'What is {e}? Finish with the sentence "The answer is <number>."',
    "one_sentence": 'Compute {e}. Reply with one sentence: "The answer is" followed by the number.',
    "plain": "What is {e}?",
}
rng = random.Random(0)
KINDS = {  # (question, answer)
    "sum_1d": lambda a=rng.randint: (f"{(x := a(0, 9))} + {(y := a(0, 9))}", x + y),
    "sum_2d": lambda a=rng.randint: (f"{(x := 10 * a(1, 4) + a(0, 4))} + {(y := 10 * a(1, 4) + a(0, 5))}", x + y),
    "sum_2d_carry": lambda a=rng.randint: (f"{(x := 10 * a(1, 8) + a(5, 9))} + {(y := 10 * a(1, 8) + a(5, 9))}", x + y),
    "sum_3": lambda a=rng.randint: (f"{(x := a(1, 9))} + {(y := a(1, 9))} + {(z := a(1, 9))}", x + y + z),
    "product_1d": lambda a=rng.randint: (f"{(x := a(2, 9))} * {(y := a(2, 9))}", x * y),
}


def main(temperature: float) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        model = build(compose("config", ["model=smollm2"]), "model")
    policy, tok = model.build("", 0)
    for wording, question in WORDINGS.items():
        for kind, draw in KINDS.items():
            rows = [q for q in (draw() for _ in range(16)) for _ in range(4)]
            prompts = [model.format_prompt(tok, question.format(e=e)) for e, _ in rows]
            with torch.no_grad():
                out = generate(policy.eval(), tok, prompts, 48, temperature=temperature)
            texts = tok.batch_decode(out.completion_ids, skip_special_tokens=True)
            strict = sum(bool(s := ANSWER.findall(t)) and int(s[-1]) == a for t, (_, a) in zip(texts, rows))
            lenient = sum(str(a) in re.findall(r"\d+", t) for t, (_, a) in zip(texts, rows))
            print(f"T={temperature} {wording} {kind}: strict {strict / 64:.2f} lenient {lenient / 64:.2f}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
