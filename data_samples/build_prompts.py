"""Build data_samples/prompts.parquet, the sample input data set.

Standalone: needs only pyarrow. Deterministic: the rows below are written in
list order with a fixed schema and no timestamps or randomness.

    python data_samples/build_prompts.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT_PATH = Path(__file__).resolve().parent / "prompts.parquet"

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=True),
        pa.field("messages", pa.list_(MESSAGE_TYPE), nullable=True),
    ]
)

LONG_PARAGRAPH = (
    "Summarize the following paragraph in two sentences.\n\n"
    "The history of the bicycle stretches back more than two hundred years. "
    "In 1817 the German inventor Karl Drais built a two-wheeled 'running "
    "machine' that riders pushed along with their feet; it had no pedals, but "
    "it proved that a person could balance on two wheels in a line. Over the "
    "following decades, French mechanics attached pedals directly to the front "
    "wheel, creating the velocipede, nicknamed the 'boneshaker' because of its "
    "iron tyres and rough ride on cobbled streets. To go faster, makers "
    "enlarged the front wheel, which led to the high-wheeler or penny-farthing "
    "of the 1870s. It was quick but dangerous: a rider perched high above the "
    "ground could be thrown head-first by a single stone. The breakthrough "
    "came in the 1880s with the 'safety bicycle', which had two wheels of "
    "similar size and a chain that drove the rear wheel. Soon afterwards, John "
    "Boyd Dunlop's pneumatic tyre made riding far more comfortable. "
    "Factories in Britain, France and the United States began producing "
    "bicycles in large numbers, and prices fell quickly. Cycling clubs "
    "appeared in many cities, and riders pushed governments to build "
    "smoother roads, long before cars became common. These "
    "changes turned the bicycle from a risky toy for young men into practical, "
    "affordable transport for millions of people, including many women, for "
    "whom cycling became a symbol of independence. The basic design settled "
    "by 1900 is still recognisable in almost every bicycle sold today."
)

CODE_COMPLETION = '''Complete the following Python function.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals.

    Args:
        intervals: A list of (start, end) pairs with start <= end.

    Returns:
        A sorted list of non-overlapping intervals covering the same points.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])
    [(1, 6), (8, 10)]
    """
'''

BUG_FINDING = """What is the bug in this Python function, and how would you fix it?

def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers) - 1
"""

SQL_QUESTION = (
    "Given a table orders(id INTEGER, customer_id INTEGER, amount REAL, "
    "created_at DATE), write a SQL query that returns each customer_id with "
    "the total amount they spent in 2024, sorted from highest to lowest total."
)


def msg(role, content):
    return {"role": role, "content": content}


# (prompt, messages) in output order; ids are assigned p00, p01, ... below.
ROWS = [
    # factual Q&A
    ("What is the capital of Australia?", None),
    # explanation
    ("Explain in simple words why the sky looks blue during the day.", None),
    # summarization of a long paragraph (~1,500 characters)
    (LONG_PARAGRAPH, None),
    # translation
    ("Translate into French: \"The library opens at nine in the morning.\"", None),
    # arithmetic / word problem
    (
        "A baker makes 12 muffins per tray and bakes 7 trays. She sells 65 "
        "muffins. How many muffins are left? Show your steps.",
        None,
    ),
    # classification / sentiment
    (
        "Classify the sentiment of this review as positive, negative, or "
        "neutral: \"The battery lasts all day, but the screen scratches far "
        "too easily.\"",
        None,
    ),
    # extraction
    (
        "Extract the date from this sentence and write it as YYYY-MM-DD: "
        "\"The conference was moved to the 14th of March 2025 because of the "
        "strike.\"",
        None,
    ),
    # creative writing: poem
    ("Write a four-line poem about rain on a tin roof.", None),
    # creative writing: story
    ("Write a very short story (three sentences) about a robot who learns to garden.", None),
    # list generation
    ("List five fruits that are high in vitamin C.", None),
    # rewriting / formal tone
    (
        "Rewrite this message in a polite, formal tone: \"hey, send me the "
        "report asap, it's late again.\"",
        None,
    ),
    # Python code completion (real newlines + indentation)
    (CODE_COMPLETION, None),
    # bug finding
    (BUG_FINDING, None),
    # SQL
    (SQL_QUESTION, None),
    # accents
    (
        "Is it naïve to send the same Résumé to every company? I am applying "
        "for jobs in Zürich.",
        None,
    ),
    # Spanish with ñ
    ("¿Cuántos años tiene que tener un niño para aprender a nadar? Responde en español.", None),
    # German with ß
    ("Was bedeutet das Wort „Straße“ auf Englisch? Antworte kurz.", None),
    # Chinese
    ("请用一句话解释什么是机器学习。", None),
    # Japanese
    ("日本で一番高い山は何ですか？", None),
    # Korean
    ("김치를 만드는 기본 재료 세 가지를 알려 주세요.", None),
    # edge case: empty prompt
    ("", None),
    # edge case: prompt and messages both null
    (None, None),
    # emoji incl. multi-codepoint (ZWJ sequence, flag)
    (
        "I just started a new job as a developer 👩‍💻 in Japan 🇯🇵! Suggest "
        "three tips for my first week. 🎉",
        None,
    ),
    # right-to-left snippet (Arabic)
    ("What does the Arabic phrase \"مرحبا بالعالم\" mean in English?", None),
    # chat: system + user
    (
        None,
        [
            msg("system", "You are a terse assistant that answers in one sentence."),
            msg("user", "Why do cats purr?"),
        ],
    ),
    # chat: system + user
    (
        None,
        [
            msg("system", "You are a friendly cooking assistant. Give clear, numbered steps."),
            msg("user", "How do I make a simple tomato sauce for pasta?"),
        ],
    ),
    # chat: multi-turn system + user + assistant + user
    (
        None,
        [
            msg("system", "You are a patient math tutor for children."),
            msg("user", "What is 7 times 8?"),
            msg("assistant", "7 times 8 is 56."),
            msg("user", "And what is 56 divided by 4?"),
        ],
    ),
    # chat: system + user
    (
        None,
        [
            msg("system", "You are a helpful assistant who always answers in Spanish."),
            msg("user", "What is a good name for a small brown dog?"),
        ],
    ),
    # more factual / explanation
    ("How many days are there in a leap year?", None),
    ("Explain the difference between a list and a tuple in Python.", None),
    ("Give me three ideas for a rainy-day activity with kids.", None),
    ("Translate into German: \"Where is the train station?\"", None),
]


def build_table():
    ids = [f"p{i:02d}" for i in range(len(ROWS))]
    prompts = [p for p, _ in ROWS]
    messages = [m for _, m in ROWS]
    return pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "prompt": pa.array(prompts, type=pa.string()),
            "messages": pa.array(messages, type=pa.list_(MESSAGE_TYPE)),
        },
        schema=SCHEMA,
    )


def main():
    table = build_table()
    pq.write_table(table, OUT_PATH)
    print(f"wrote {table.num_rows} rows to {OUT_PATH}")


if __name__ == "__main__":
    main()
