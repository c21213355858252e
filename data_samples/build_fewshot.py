"""Write fewshot_5.parquet: 512 five-shot multiple-choice prompts in MMLU's prompt style, for measuring prefix
caching (every row shares the same header and five worked exemplars, about 600 tokens, and ends in its own
question of about 40 tokens).

The layout follows MMLU's (Hendrycks et al., lm-evaluation-harness's ``mmlu`` task): a header line "The
following are multiple choice questions (with answers) about <subject>.", then each exemplar as the question,
the choices as "A. ..", "B. ..", "C. ..", "D. .." lines and "Answer: X", then the test question without its
answer. The questions were written for this repository (the exemplars by hand, the test questions from a
template over made-up quantities), not taken from MMLU, ARC or any other dataset. Columns: ``id`` (``f000``
..), ``prompt`` (string), ``answer`` (string, the letter). Run from the repository root:
``python data_samples/build_fewshot.py``.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HEADER = ("The following are multiple choice questions (with answers) about high school physics. Each question "
          "is followed by four choices labeled A to D and the letter of the correct choice.\n\n")

EXEMPLARS = [
    ("A cart of mass 2 kilograms rolls without friction along a level track at 3 meters per second and collides "
     "with a second cart of equal mass that is at rest. The two carts stick together after the collision. What "
     "is the speed of the joined carts immediately after the collision?",
     ["0.5 meters per second", "1.5 meters per second", "3 meters per second", "6 meters per second"], "B"),
    ("A student drops a small steel ball from the roof of a building and measures that it takes 2 seconds to "
     "reach the ground. Ignoring air resistance and taking the acceleration due to gravity as 10 meters per "
     "second squared, and assuming the ball starts from rest when it is released, about how tall is the "
     "building?",
     ["10 meters", "20 meters", "40 meters", "5 meters"], "B"),
    ("Two resistors of 6 ohms and 3 ohms are connected in parallel across the terminals of an ideal 12 volt "
     "battery. The student records the current leaving the battery with an ammeter placed in series with it. "
     "The wires and the ammeter have negligible resistance. What current does the ammeter show?",
     ["2 amperes", "4 amperes", "6 amperes", "1.3 amperes"], "C"),
    ("A sound wave travels through air at 340 meters per second. A tuning fork produces this wave with a "
     "frequency of 170 hertz while a microphone records it a few meters away in the same room. What is the "
     "wavelength of the sound wave, given that wavelength equals wave speed divided by frequency?",
     ["0.5 meters", "2 meters", "170 meters", "57,800 meters"], "B"),
    ("A box is pushed across a rough floor by a constant horizontal force of 50 newtons and moves at a constant "
     "velocity for a distance of 4 meters. The student wants to know how much work the pushing force did on "
     "the box during this motion, where work is force times the distance moved along the force. How much "
     "work was done?",
     ["12.5 joules", "54 joules", "200 joules", "0 joules, because the velocity is constant"], "C"),
]

OBJECTS = ["a sled", "a bicycle", "a toy car", "a wooden crate", "a shopping cart", "a hockey puck", "a skateboard",
           "a metal block"]


def question(i: int) -> tuple[str, list[str], str]:
    """The ``i``-th test question (Newton's second law; distinct (mass, force) for every ``i`` < 512) and its
    answer's letter."""
    mass, accel = 2 + i % 16, 1 + i // 16
    right, force = accel, mass * accel
    wrong = [right + 1, right * 2 + 1, force * mass]
    options = wrong[: i % 4] + [right] + wrong[i % 4 :]
    text = (f"A net force of {force} newtons acts on {OBJECTS[i % 8]} of mass {mass} kilograms. What is its "
            "acceleration in meters per second squared?")
    return text, [str(v) for v in options], "ABCD"[i % 4]


def block(text: str, choices: list[str], answer: str | None) -> str:
    lines = [text, *(f"{letter}. {c}" for letter, c in zip("ABCD", choices))]
    return "\n".join(lines) + "\nAnswer:" + (f" {answer}\n\n" if answer else "")


def main(path: Path = Path(__file__).resolve().parent / "fewshot_5.parquet", rows: int = 512) -> None:
    shots = HEADER + "".join(block(*e) for e in EXEMPLARS)
    items = [question(i) for i in range(rows)]
    table = pa.table({
        "id": [f"f{i:03d}" for i in range(rows)],
        "prompt": [shots + block(q, c, None) for q, c, _ in items],
        "answer": [a for _, _, a in items],
    })
    pq.write_table(table, path)
    print(f"wrote {path} ({rows} rows)")


if __name__ == "__main__":
    main()
