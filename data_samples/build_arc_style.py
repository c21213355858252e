"""Write arc_style.parquet: 20 hand-written ARC-style science questions, 4 choices each, for `task: score`.

Written for this repository (not taken from ARC or any other dataset). Columns: ``id`` (``q00`` ..),
``question`` (string), ``choices`` (list<string>, 4 each), ``answer`` (int32, the correct choice's index).
Run from the repository root: ``python data_samples/build_arc_style.py``.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = [
    ("Which gas do plants take in from the air to make their food?", ["carbon dioxide", "oxygen", "nitrogen", "helium"], 0),
    ("What force pulls objects toward the center of the Earth?", ["magnetism", "friction", "gravity", "electricity"], 2),
    ("Which part of a plant takes up water from the soil?", ["the leaves", "the roots", "the flowers", "the seeds"], 1),
    ("What is the boiling point of water at sea level?", ["50 degrees Celsius", "0 degrees Celsius", "200 degrees Celsius", "100 degrees Celsius"], 3),
    ("Which planet is closest to the Sun?", ["Mercury", "Venus", "Mars", "Jupiter"], 0),
    ("What do we call an animal that eats only plants?", ["a carnivore", "a herbivore", "an omnivore", "a predator"], 1),
    ("Which state of matter has a fixed shape and volume?", ["gas", "liquid", "solid", "plasma"], 2),
    ("What does a thermometer measure?", ["mass", "speed", "volume", "temperature"], 3),
    ("Which organ pumps blood through the human body?", ["the heart", "the lungs", "the liver", "the stomach"], 0),
    ("What causes day and night on Earth?", ["the Moon's orbit", "the Earth's rotation", "the Sun's rotation", "the seasons"], 1),
    ("Which of these is a source of renewable energy?", ["coal", "natural gas", "wind", "oil"], 2),
    ("What is formed when water vapor cools and condenses in the sky?", ["rocks", "soil", "sand", "clouds"], 3),
    ("Which tool is best for looking at very small cells?", ["a microscope", "a telescope", "a ruler", "a magnet"], 0),
    ("What happens to ice when it is heated above 0 degrees Celsius?", ["it freezes", "it melts", "it becomes harder", "it turns into rock"], 1),
    ("Which material is a good conductor of electricity?", ["wood", "rubber", "copper", "glass"], 2),
    ("How many legs does an insect have?", ["four", "eight", "ten", "six"], 3),
    ("What is the main source of light for the Earth during the day?", ["the Sun", "the Moon", "the stars", "lightning"], 0),
    ("Which layer of the Earth do we live on?", ["the core", "the crust", "the mantle", "the magma"], 1),
    ("What do bees collect from flowers to make honey?", ["leaves", "bark", "nectar", "roots"], 2),
    ("Which of these animals is a mammal?", ["a shark", "a frog", "a lizard", "a whale"], 3),
]


def main(path: Path = Path(__file__).resolve().parent / "arc_style.parquet") -> None:
    table = pa.table({
        "id": [f"q{i:02d}" for i in range(len(ROWS))],
        "question": [q for q, _, _ in ROWS],
        "choices": pa.array([c for _, c, _ in ROWS], pa.list_(pa.string())),
        "answer": pa.array([a for _, _, a in ROWS], pa.int32()),
    })
    pq.write_table(table, path)
    print(f"wrote {path} ({table.num_rows} rows)")


if __name__ == "__main__":
    main()
