"""A deterministic local English corpus for benchmark prompts.

The text comes from seeded templates filled from word lists (science, history, cooking,
travel, code comments, dialogue, and facts with names and numbers), so a benchmark needs no
download and every prompt is reproducible from a seed. The text reads like English, which
matters because a tokenizer splits real words differently from random characters: prompt
token counts, prefix-cache hashes and sparsity patterns then look like those of real traffic.

All functions take a `numpy.random.Generator`, or a seed where they build one.
"""

from __future__ import annotations

import numpy as np

_FIRST_NAMES = (
    "Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid", "Jamal",
    "Keiko", "Lars", "Mei", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Samir", "Tomas",
    "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zofia",
)
_LAST_NAMES = (
    "Abara", "Berger", "Castillo", "Dubois", "Eriksen", "Fontaine", "Gupta", "Hansen", "Ito",
    "Jovanovic", "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quispe",
    "Rossi", "Silva", "Tanaka", "Ueda", "Varga", "Weber", "Yilmaz", "Zhou",
)
_CITIES = (
    "Lisbon", "Kyoto", "Nairobi", "Oslo", "Montreal", "Valparaiso", "Hanoi", "Krakow", "Tbilisi",
    "Adelaide", "Marrakesh", "Reykjavik", "Cusco", "Tallinn", "Porto", "Seville", "Bergen",
    "Lima", "Zanzibar", "Ljubljana",
)
_SCIENCE_NOUNS = (
    "enzyme", "protein", "crystal", "galaxy", "neutron star", "bacterium", "glacier", "volcano",
    "semiconductor", "catalyst", "magnetic field", "coral reef", "superconductor", "comet",
    "neuron", "mitochondrion", "polymer", "quasar", "aquifer", "isotope",
)
_SCIENCE_VERBS = (
    "absorbs", "emits", "stabilizes", "accelerates", "inhibits", "reflects", "amplifies",
    "converts", "dissolves", "regulates",
)
_SCIENCE_THINGS = (
    "ultraviolet light", "heat", "oxygen", "electric charge", "carbon dioxide", "water vapor",
    "radio waves", "glucose", "calcium ions", "sound",
)
_SIZE_UNITS = ("nanometers", "micrometers", "millimeters", "kilometers")
_EVENTS = (
    "the founding of a harbor guild", "a long drought", "the opening of a railway",
    "a treaty between two river towns", "the first public library", "a great fire",
    "the arrival of the printing press", "a failed harvest", "the building of a stone bridge",
    "a bitter succession dispute",
)
_HISTORY_ROLES = ("merchant", "cartographer", "abbess", "general", "poet", "engineer", "judge")
_INGREDIENTS = (
    "garlic", "onions", "lentils", "rice", "butter", "lemon zest", "fresh basil", "chickpeas",
    "tomatoes", "ginger", "cumin", "flour", "eggs", "spinach", "mushrooms", "yogurt", "honey",
    "black pepper", "olive oil", "coconut milk",
)
_COOKING_VERBS = ("simmer", "roast", "whisk", "saute", "fold in", "braise", "toast", "knead")
_DISHES = ("stew", "risotto", "flatbread", "curry", "omelette", "soup", "pilaf", "tart")
_SIGHTS = (
    "the old market", "a hillside monastery", "the river promenade", "a botanical garden",
    "the harbor lighthouse", "a covered bridge", "the night bazaar", "a hot spring",
)
_TRANSPORT = ("train", "ferry", "bus", "bicycle", "tram", "night bus", "cable car")
_CODE_THINGS = (
    "the request queue", "the block table", "this cache entry", "the free list",
    "the retry counter", "the page allocator", "the token buffer", "the scheduler state",
)
_CODE_REASONS = (
    "the caller may hold a stale reference", "the buffer is reused on the next step",
    "another thread could observe a partial write", "the length can be zero here",
    "the device may still be reading it", "the index is exclusive at the end",
)
_QUESTIONS = (
    "What time does the museum open", "Could you explain how the tides work",
    "Why does bread need to rest", "Which train goes to the coast",
    "How do I fix this failing test", "What should I read about the old empire",
    "Is it safe to swim in the lake", "How long should the stew simmer",
)
_ANSWERS = (
    "It depends on the season, but usually early in the morning",
    "Mostly because of the moon, with some help from the sun",
    "So the gluten can relax and the dough becomes easier to shape",
    "The regional line that leaves from the second platform",
    "Start by reading the error message and the line it points to",
    "A short history of the trade routes is a good place to begin",
    "Only near the marked beach, where lifeguards watch the water",
    "At least an hour, until the meat falls apart with a spoon",
)
_ADJECTIVES = (
    "quiet", "remarkable", "narrow", "ancient", "bright", "unexpected", "careful", "gentle",
    "stubborn", "generous", "steep", "crowded", "delicate", "patient",
)


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def _a(word: str) -> str:
    """The word with its indefinite article."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _name(rng: np.random.Generator) -> str:
    return f"{_pick(rng, _FIRST_NAMES)} {_pick(rng, _LAST_NAMES)}"


def _science(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"The {_pick(rng, _SCIENCE_NOUNS)} {_pick(rng, _SCIENCE_VERBS)} "
                 f"{_pick(rng, _SCIENCE_THINGS)} faster when the temperature rises above "
                 f"{int(rng.integers(5, 900))} degrees Celsius."),
        lambda: (f"In {int(rng.integers(1890, 2024))}, {_name(rng)} measured how "
                 f"{_a(_pick(rng, _SCIENCE_NOUNS))} {_pick(rng, _SCIENCE_VERBS)} "
                 f"{_pick(rng, _SCIENCE_THINGS)}."),
        lambda: (f"{_a(_pick(rng, _ADJECTIVES)).capitalize()} experiment showed that each "
                 f"{_pick(rng, _SCIENCE_NOUNS)} is about {int(rng.integers(2, 999))} "
                 f"{_pick(rng, _SIZE_UNITS)} across."),
        lambda: (f"Researchers still debate whether the {_pick(rng, _SCIENCE_NOUNS)} "
                 f"{_pick(rng, _SCIENCE_VERBS)} {_pick(rng, _SCIENCE_THINGS)} or merely "
                 f"stores it for a while."),
    )
    return templates[int(rng.integers(len(templates)))]()


def _history(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"In the year {int(rng.integers(800, 1900))}, {_pick(rng, _CITIES)} "
                 f"saw {_pick(rng, _EVENTS)}."),
        lambda: (f"The {_pick(rng, _HISTORY_ROLES)} {_name(rng)} kept "
                 f"{_a(_pick(rng, _ADJECTIVES))} diary of {_pick(rng, _EVENTS)}."),
        lambda: (f"Historians link {_pick(rng, _EVENTS)} to the rise of "
                 f"{_pick(rng, _CITIES)} as a trading town."),
        lambda: (f"For {int(rng.integers(3, 120))} years after {_pick(rng, _EVENTS)}, "
                 f"the people of {_pick(rng, _CITIES)} paid their taxes in salt."),
    )
    return templates[int(rng.integers(len(templates)))]()


def _cooking(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"{_pick(rng, _COOKING_VERBS).capitalize()} the {_pick(rng, _INGREDIENTS)} "
                 f"with {_pick(rng, _INGREDIENTS)} for {int(rng.integers(2, 45))} minutes."),
        lambda: (f"A good {_pick(rng, _DISHES)} needs {int(rng.integers(1, 6))} cups of "
                 f"{_pick(rng, _INGREDIENTS)} and a pinch of {_pick(rng, _INGREDIENTS)}."),
        lambda: (f"Heat the oven to {int(rng.integers(16, 25)) * 10} degrees before you "
                 f"{_pick(rng, _COOKING_VERBS)} the {_pick(rng, _INGREDIENTS)}."),
        lambda: (f"My grandmother served her {_pick(rng, _ADJECTIVES)} {_pick(rng, _DISHES)} "
                 f"with {_pick(rng, _INGREDIENTS)} on top."),
    )
    return templates[int(rng.integers(len(templates)))]()


def _travel(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"From {_pick(rng, _CITIES)}, take the {_pick(rng, _TRANSPORT)} to "
                 f"{_pick(rng, _SIGHTS)}; the trip takes about {int(rng.integers(10, 90))} "
                 f"minutes."),
        lambda: (f"Visitors to {_pick(rng, _CITIES)} should not miss {_pick(rng, _SIGHTS)}, "
                 f"which is {_pick(rng, _ADJECTIVES)} in the early morning."),
        lambda: (f"A ticket for the {_pick(rng, _TRANSPORT)} costs {int(rng.integers(2, 40))} "
                 f"euros and runs every {int(rng.integers(5, 60))} minutes."),
        lambda: (f"We stayed {int(rng.integers(2, 14))} nights in {_pick(rng, _CITIES)} and "
                 f"walked to {_pick(rng, _SIGHTS)} every evening."),
    )
    return templates[int(rng.integers(len(templates)))]()


def _code_comment(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"# Copy {_pick(rng, _CODE_THINGS)} before freeing it, because "
                 f"{_pick(rng, _CODE_REASONS)}."),
        lambda: (f"# Check {_pick(rng, _CODE_THINGS)} again after the lock is released: "
                 f"{_pick(rng, _CODE_REASONS)}."),
        lambda: (f"# Keep at most {2 ** int(rng.integers(3, 12))} entries in "
                 f"{_pick(rng, _CODE_THINGS)}; beyond that the lookup gets slow."),
        lambda: (f"# {_name(rng)} noticed that {_pick(rng, _CODE_THINGS)} can overflow "
                 f"when {_pick(rng, _CODE_REASONS)}."),
    )
    return templates[int(rng.integers(len(templates)))]()


def _dialogue(rng: np.random.Generator) -> str:
    index = int(rng.integers(len(_QUESTIONS)))
    first, second = _pick(rng, _FIRST_NAMES), _pick(rng, _FIRST_NAMES)
    return f'{first} asked, "{_QUESTIONS[index]}?" {second} replied, "{_ANSWERS[index]}."'


def _fact(rng: np.random.Generator) -> str:
    templates = (
        lambda: (f"{_name(rng)} was born in {_pick(rng, _CITIES)} in "
                 f"{int(rng.integers(1900, 2010))} and moved away at the age of "
                 f"{int(rng.integers(5, 60))}."),
        lambda: (f"The library in {_pick(rng, _CITIES)} holds "
                 f"{int(rng.integers(1_000, 2_000_000)):,} books and "
                 f"{int(rng.integers(10, 900))} maps."),
        lambda: (f"{_name(rng)} owns {int(rng.integers(2, 40))} bicycles and "
                 f"{int(rng.integers(1, 9))} cats."),
        lambda: (f"The distance from {_pick(rng, _CITIES)} to {_pick(rng, _CITIES)} is "
                 f"{int(rng.integers(50, 9000))} kilometers."),
    )
    return templates[int(rng.integers(len(templates)))]()


_TOPICS = (_science, _history, _cooking, _travel, _code_comment, _dialogue, _fact)


def _sentence(rng: np.random.Generator, topic: int) -> str:
    return _TOPICS[topic](rng)


def _sentences(rng: np.random.Generator, num_words: int) -> list[str]:
    """Sentences whose words add up to at least `num_words`, topic runs of a few sentences."""
    sentences: list[str] = []
    count = 0
    topic = int(rng.integers(len(_TOPICS)))
    while count < num_words:
        if rng.random() < 0.3:
            topic = int(rng.integers(len(_TOPICS)))
        sentence = _sentence(rng, topic)
        sentences.append(sentence)
        count += len(sentence.split())
    return sentences


def make_text(rng: np.random.Generator, num_words: int) -> str:
    """English text of exactly `num_words` whitespace-separated words.

    Sentences are drawn in runs on one topic at a time; the last sentence is cut to fit and
    closed with a period.
    """
    if not isinstance(num_words, int) or num_words < 0:
        raise ValueError(f"num_words must be a non-negative int, got {num_words!r}")
    words = " ".join(_sentences(rng, num_words)).split()[:num_words]
    if words and words[-1][-1] not in ".?!\"":
        words[-1] = words[-1].rstrip(",;:") + "."
    return " ".join(words)


def make_corpus(seed: int, num_docs: int, *, min_words: int = 40,
                max_words: int = 400) -> list[str]:
    """`num_docs` documents of `min_words`..`max_words` words each, deterministic per seed."""
    if num_docs < 0:
        raise ValueError(f"num_docs must be non-negative, got {num_docs}")
    if not 0 < min_words <= max_words:
        raise ValueError(f"need 0 < min_words <= max_words, got {min_words}, {max_words}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_words, max_words + 1, size=num_docs)
    return [make_text(rng, int(length)) for length in lengths]


def make_needle_prompt(rng: np.random.Generator, filler_words: int, key: str, value: int | str,
                       position_fraction: float) -> tuple[str, str]:
    """A retrieval probe: one fact planted in long filler text, asked about at the end.

    The fact "The secret code of {key} is {value}." goes in at the sentence boundary nearest
    to `position_fraction` of the filler (0 = start, 1 = end). The prompt ends with a
    question whose answer is `str(value)`.

    Returns:
        (prompt_text, answer).
    """
    if not 0.0 <= position_fraction <= 1.0:
        raise ValueError(f"position_fraction must be in [0, 1], got {position_fraction}")
    if filler_words < 0:
        raise ValueError(f"filler_words must be non-negative, got {filler_words}")
    sentences = _sentences(rng, filler_words) if filler_words else []
    ends = np.cumsum([len(s.split()) for s in sentences])
    boundaries = np.concatenate([[0], ends])  # words before each insertion point
    target = position_fraction * (boundaries[-1] if len(ends) else 0)
    insert_at = int(np.argmin(np.abs(boundaries - target)))
    needle = f"The secret code of {key} is {value}."
    parts = sentences[:insert_at] + [needle] + sentences[insert_at:]
    question = (f"Question: What is the secret code of {key}? "
                f"Answer: The secret code of {key} is")
    return " ".join(parts) + "\n\n" + question, str(value)
