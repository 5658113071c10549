"""The words that niah keys and word values are made of, as RULER makes them: ``adjective-noun``.

RULER draws its keys from a word list rather than from the haystack. A key made of the
haystack's own words is a distractor planted by the task itself: the text quotes those words
elsewhere, and a model may answer with one of them. So the key words here are everyday English
words, and :func:`absent_words` keeps only those that the haystack does not contain.
"""

from __future__ import annotations

import re

ADJECTIVES = (
    "amber", "ancient", "arctic", "bashful", "bitter", "blissful", "bouncy", "brave", "breezy",
    "bright", "brisk", "bumpy", "calm", "cheerful", "chilly", "chubby", "clumsy", "cozy", "crimson",
    "crispy", "crunchy", "curly", "dainty", "dapper", "dizzy", "drowsy", "dusty", "eager", "earnest",
    "elegant", "fancy", "fluffy", "foggy", "fragrant", "frosty", "fuzzy", "gentle", "giddy",
    "gleaming", "glossy", "golden", "graceful", "grumpy", "hasty", "hazy", "hearty", "hollow",
    "humble", "icy", "jagged", "jolly", "jovial", "juicy", "keen", "lanky", "lavish", "lively",
    "lofty", "lucky", "mellow", "merry", "misty", "modest", "muddy", "nimble", "noisy", "plump",
    "polished", "proud", "quaint", "quirky", "rapid", "rosy", "rowdy", "rugged", "rusty", "salty",
    "sandy", "scarlet", "shaggy", "shiny", "silky", "sleepy", "slender", "snowy", "soggy",
    "sparkly", "spicy", "spotted", "steady", "sticky", "stormy", "sturdy", "sunny", "swift", "tangy",
    "tender", "thirsty", "tidy", "velvet", "vivid", "wary", "wavy", "wealthy", "wiggly", "windy",
    "witty", "woolly", "zesty",
)
NOUNS = (
    "acorn", "alpaca", "anchor", "apricot", "avocado", "badger", "bagel", "bamboo", "banjo", "beaver",
    "beetle", "biscuit", "blossom", "bonnet", "buffalo", "butterfly", "cactus", "camel", "canoe",
    "caramel", "carrot", "cashew", "castle", "cheetah", "cherry", "chestnut", "cobbler", "coconut",
    "cricket", "crocodile", "cupcake", "daisy", "dolphin", "donkey", "dragonfly", "dumpling", "eagle",
    "falcon", "ferret", "flamingo", "fossil", "gazelle", "gecko", "giraffe", "goose", "gorilla",
    "harbor", "hazelnut", "hedgehog", "heron", "hippo", "iguana", "jaguar", "jellyfish", "kangaroo",
    "kettle", "kiwi", "koala", "ladybug", "lantern", "lemur", "lobster", "mango", "meadow", "meerkat",
    "mitten", "moose", "muffin", "mushroom", "nectarine", "octopus", "orchard", "ostrich", "otter",
    "owl", "panda", "papaya", "parsnip", "peacock", "pebble", "pelican", "penguin", "pickle",
    "pinecone", "platypus", "pretzel", "pumpkin", "quail", "raccoon", "radish", "reindeer", "rhubarb",
    "saddle", "salmon", "sparrow", "squirrel", "starfish", "teapot", "thimble", "tortoise", "toucan",
    "tulip", "turnip", "umbrella", "volcano", "walnut", "walrus", "weasel", "whistle", "willow",
    "wombat", "yak", "zebra",
)
MINIMUM = 10
"""Fewest adjectives and nouns a text may leave: 100 keys, enough for any task's distinct draws."""


def absent_words(text: str) -> tuple[list[str], list[str]]:
    """The adjectives and nouns that occur nowhere in ``text`` (as words, in any case)."""
    present = set(re.findall(r"[a-z]+", text.lower()))
    adjectives = [word for word in ADJECTIVES if word not in present]
    nouns = [word for word in NOUNS if word not in present]
    if min(len(adjectives), len(nouns)) < MINIMUM:
        raise ValueError(
            f"the haystack contains all but {len(adjectives)} of the {len(ADJECTIVES)} key adjectives and "
            f"{len(nouns)} of the {len(NOUNS)} key nouns (a key needs words the text lacks, {MINIMUM} of each): "
            "use another text"
        )
    return adjectives, nouns
