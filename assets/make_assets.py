#!/usr/bin/env python3
"""Regenerate the bundled sample data, tokenizer and README:  python assets/make_assets.py

Offline and deterministic: all randomness comes from seeded random.Random
instances (one per source, so editing one generator does not shift the
others), gzip headers carry mtime=0 and parquet files hold no timestamps, so
every run rewrites the same bytes. The text is synthetic (built from the word
lists and templates below), hence free to redistribute, and deliberately
repetitive so that a tiny LM's loss drops within a few dozen steps.
Needs: pyarrow, tiktoken, regex (tiktoken cannot pre-tokenize on its own).
"""
import base64
import gzip
import json
import math
import os
import random
import shutil
import time
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

ROOT = os.path.dirname(os.path.abspath(__file__))
# Llama 3's pre-tokenizer regex
PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
N_BPE = 1792  # + Llama 3's 256 special tokens = 2048

# ---------------------------------------------------------------- vocabulary
# Space-separated lists; a list that needs multi-word entries ("market day") is comma-separated.
WORD_LISTS = dict(
    noun=("garden kitchen river market village teacher student window bridge engine library "
          "museum farmer bicycle forest mountain neighbor painting camera computer phone book "
          "story lesson island road journey festival storm harbor school office friend family "
          "team player coach song movie photo map child doctor artist driver visitor shop house "
          "street table letter plan idea question problem"),
    adj=("small large bright quiet busy fresh simple warm cold green old new modern local popular "
         "careful strong gentle clever friendly useful beautiful early late happy cheap reliable "
         "heavy light sturdy"),
    adv="quickly slowly carefully often rarely usually quietly easily together again early",
    food=("onion carrot lemon apple pepper mushroom cucumber noodle dumpling cookie muffin pancake "
          "egg bean almond"),
    mass=("rice flour butter sugar garlic cheese milk honey salt yogurt cream chocolate pasta soup "
          "ginger"),
    unit="cup tablespoon teaspoon gram pinch slice handful",
    cook="chop stir bake boil slice mix fry roast whisk season",
    product=("backpack lamp speaker blender kettle jacket charger chair desk mattress umbrella "
             "watch tent bottle"),
    brand="Northwind Bluepeak Harbor Lumen Everwood Kestrel Solace Maple Corvid Tidal",
    place=("park library station beach harbor market square museum stadium valley kitchen garden "
           "classroom"),
    name=("Anna Ben Carlos Dana Elena Farid Grace Hiro Ines Jonah Kira Liam Maya Noah Olga Priya "
          "Quinn Ravi Sara Tom Uma Victor Wen Yara Zoe"),
    city=("Riverton Maplewood Eastbrook Lakeside Stonehill Fairview Oakridge Westport Brightwater "
          "Millbrook Ashford Redcliff"),
    role="spokesperson manager teacher engineer volunteer director researcher nurse",
    org="council library hospital school board museum club",
    timeunit="day week month year morning evening weekend season",
    event="meeting,festival,storm,holiday,game,concert,market day,school year",
    month="January February March April May June July August September October November December",
    field="biology chemistry physics geography history mathematics astronomy ecology economics",
    concept=("photosynthesis,erosion,gravity,electricity,magnetism,digestion,evaporation,friction,"
             "pollination,condensation,migration,inflation,democracy,trade,the water cycle,"
             "plate tectonics,the food chain,climate"),
    site=("dailyhomenotes bestkitchen cityweekly shopnorth learnwell townherald gearcorner "
          "familytable"),
)
W = {k: v.split(",") if "," in v else v.split() for k, v in WORD_LISTS.items()}
# base form | 3rd person singular | past tense
VERB_TABLE = (
    "build builds built|make makes made|find finds found|visit visits visited|"
    "clean cleans cleaned|paint paints painted|carry carries carried|fix fixes fixed|"
    "watch watches watched|share shares shared|open opens opened|move moves moved|"
    "help helps helped|check checks checked|plan plans planned|use uses used|keep keeps kept|"
    "test tests tested|change changes changed|explore explores explored"
)
VERBS = [v.split() for v in VERB_TABLE.split("|")]
VERB_FORM = {"verb": 0, "verbs": 1, "verbed": 2}

def plural(w):
    if w.endswith(("s", "sh", "ch", "x")):
        return w + "es"
    if w.endswith("y") and w[-2] not in "aeiou":
        return w[:-1] + "ies"
    return w + "s"

def word(rng, key):
    """One slot: {noun}, {Noun} (capitalized), {nouns} (plural), {verbed}, {num}, ..."""
    if key == "num":
        return str(rng.choice([2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 20, 25, 30, 40, 50, 100]))
    base = key.lower()
    if base in VERB_FORM:
        w = rng.choice(VERBS)[VERB_FORM[base]]
    elif base in W:
        w = rng.choice(W[base])
    else:  # a plural slot: {nouns} is the plural of a {noun}
        w = plural(rng.choice(W[base[:-1]]))
    return w[0].upper() + w[1:] if key[0].isupper() else w

def fill(rng, template):
    s = regex.sub(r"\{(\w+)\}", lambda m: word(rng, m.group(1)), template)
    s = regex.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", s)  # "a engine" -> "an engine"
    return s[0].upper() + s[1:]

def T(block):  # one template per line
    return [t.strip() for t in block.strip().splitlines()]

GENERAL = T("""
The {adj} {noun} near the {place} {verbs} every {timeunit}.
Many {nouns} {verb} {adv} when the {noun} is {adj}.
{name} {verbed} the {adj} {noun} before the {event}.
If you want a {adj} {noun}, {verb} the {noun} {adv}.
Our {nouns} are {adj} and {adj}, so {nouns} {verb} them {adv}.
We {verbed} {num} {nouns} last {timeunit}, and the results were {adj}.
It is {adj} to {verb} a {noun} without a {noun}.
This {noun} {verbs} {adv}, which makes it {adj} for {nouns}.
{name} and {name} {verbed} to the {place} to see the {adj} {noun}.
Most {nouns} in the {place} {verb} {num} {nouns} a {timeunit}.
The {noun} was {adj}, but the {nouns} were even more {adj}.
After the {event}, the {nouns} {verbed} {adv}.
There are {num} {adj} {nouns} in our {place}.
Why do {nouns} {verb} {adv}? Because the {noun} is {adj}.
In {month}, the {place} {verbs} a {adj} {event} for {nouns}.
Every {timeunit}, {name} {verbs} the {noun} and {verbs} a {adj} {noun}.""")
WEB = T("""
Click here to {verb} more {adj} {nouns}.
Thanks for reading, and {verb} your {nouns} {adv}!
Sign up for our newsletter to get {adj} {nouns} every {timeunit}.
Share this post with a {noun} who loves {adj} {nouns}.""")
FIRST = T("""
I have been using this {product} for {num} {timeunits} and it is {adj}.
My {noun} {verbed} the {noun} {adv}, which surprised me.
Honestly, I think the {noun} is too {adj} for most {nouns}.
Has anyone else {verbed} a {adj} {noun} like this?
Update: after {num} {timeunits}, the {product} still {verbs} {adv}.
I would recommend it to anyone who needs a {adj} {product}.""")
FOOD = T("""
This {adj} {food} dish is {adj} enough for a {adj} {timeunit}.
You can {cook} the {foods} with a little {mass} and {mass}.
My {noun} always asks for more {mass} on the {foods}.
Use {adj} {foods} if you can find them at the {place}.""")
STEPS = T("""
{Cook} the {foods} for {num} minutes.
Add the {mass} and {cook} until {adj}.
{Cook} the {mass} with the {foods} in a {adj} pan.
Let it rest for {num} minutes, then {cook} again.
Serve with {mass} and a {adj} {food}.""")
NEWS = T("""
"We {verbed} the {noun} {adv}," said {name}, a {role} at the {city} {org}.
Officials {verbed} {num} {nouns} near the {place} on {month} {num}.
The {org} plans to {verb} a {adj} {noun} by next {timeunit}.
Residents said the {event} was {adj} and {adj}.
The {city} {org} {verbed} the plan after a {adj} meeting.""")
EDU = T("""
{Concept} is an important idea in {field}.
To understand {concept}, students first {verb} a simple {noun}.
Teachers often explain {concept} with a {adj} {noun} and a {noun}.
When the {noun} becomes {adj}, {concept} changes how {nouns} {verb}.
Scientists have studied {concept} for more than {num} years.
One way to see {concept} is to {verb} {num} {nouns} and record what happens.
This is why {concept} matters for {nouns} and {nouns} alike.
For example, a {noun} in a {place} shows {concept} very clearly.
In {field}, {concept} {verbs} the {adj} {nouns} around us.""")

def para(rng, templates, lo=3, hi=7):
    return " ".join(fill(rng, rng.choice(templates)) for _ in range(rng.randint(lo, hi)))

def grow(rng, blocks, target, body):
    """Append body blocks until the doc has ~target words (doc lengths vary a lot)."""
    while sum(len(b.split()) for b in blocks) < target:
        blocks.append(body())
    return "\n\n".join(blocks)

# ---------------------------------------------------------------- documents
def c4_doc(rng, target):
    kind = rng.choice(["article", "article", "recipe", "product", "news"])
    if kind == "recipe":
        title = fill(rng, "{Adj} {Foods} with {Mass}")
        qty = [rng.randint(1, 4) for _ in range(rng.randint(3, 8))]
        ing_lines = []
        for q in qty:
            unit = word(rng, "unit") if q == 1 else word(rng, "units")
            what = word(rng, rng.choice(["foods", "mass"]))
            ing_lines.append(f"- {q} {unit} {what}")
        ings = "\n".join(ing_lines)
        stop = rng.randint(4, 9)  # steps are numbered 1 .. stop - 1
        steps = "\n".join(f"{i}. {fill(rng, rng.choice(STEPS))}" for i in range(1, stop))
        intro = para(rng, FOOD + GENERAL, 2, 4)
        serves = rng.randint(2, 8)
        minutes = rng.randint(2, 12) * 5
        footer = f"Serves {serves}. Preparation time: {minutes} minutes."
        blocks = [title, intro, "Ingredients:\n" + ings, "Instructions:\n" + steps, footer]
        text = grow(rng, blocks, target, lambda: "Tip: " + para(rng, FOOD, 1, 4))
    elif kind == "product":
        title = f"{word(rng, 'brand')} {fill(rng, '{Adj} {Product}')} X{rng.randint(1, 9)}00"
        feature_templates = [
            "{adj} design that {verbs} {adv}",
            "weighs only {num} ounces",
            "includes a {adj} {noun}",
            "works for {num} {timeunits}",
        ]
        n_feats = rng.randint(3, 6)
        feats = "\n".join("- " + fill(rng, rng.choice(feature_templates)) for _ in range(n_feats))
        intro = para(rng, GENERAL, 2, 3)
        price = f"Price: ${rng.randint(9, 199)}.99. Free shipping on orders over $50."
        blocks = [title, intro, "Features:\n" + feats, price, "Customer reviews:"]

        def review():
            stars = rng.randint(1, 5)
            return f"{stars} out of 5 stars. " + para(rng, FIRST, 1, 4)
        text = grow(rng, blocks, target, review)
    elif kind == "news":
        title = fill(rng, "{City} {Org} {Verbs} {Adj} {Noun}")
        dateline = f"{word(rng, 'city')}, {word(rng, 'month')} {rng.randint(1, 28)} - "
        blocks = [title, dateline + para(rng, NEWS)]
        text = grow(rng, blocks, target, lambda: para(rng, NEWS + GENERAL))
    else:
        title_templates = [
            "{num} {Adj} Ways to {Verb} Your {Noun}",
            "Why {Nouns} {Verb} {Adv}",
            "A {Adj} Guide to the {Place}",
        ]
        title = fill(rng, rng.choice(title_templates))

        def section():  # some sections get a heading
            heading = fill(rng, "{Adj} {Nouns}") + "\n" if rng.random() < 0.3 else ""
            return heading + para(rng, GENERAL + WEB[:1])
        text = grow(rng, [title, para(rng, GENERAL)], target, section)
        text += "\n\n" + fill(rng, rng.choice(WEB))
    return text, title

def dclm_doc(rng, target):
    if rng.random() < 0.5:  # forum / review style
        title_templates = ["How to {verb} a {adj} {noun}?", "Review: {Brand} {Product}"]
        title = fill(rng, rng.choice(title_templates))

        def post():
            author = word(rng, "name")
            month = word(rng, "month")
            day = rng.randint(1, 28)
            year = rng.randint(2010, 2023)
            return f"Posted by {author} on {month} {day}, {year}\n" + para(rng, FIRST + GENERAL)
        text = grow(rng, [title, para(rng, FIRST)], target, post)
        return text, title
    title = fill(rng, "The {Adj} {Noun} of {City}")
    return grow(rng, [title], target, lambda: para(rng, GENERAL + NEWS)), title

def fwe_doc(rng, target):
    concept = word(rng, "Concept")
    topic = concept.lower()  # the mid-sentence form
    grade = rng.randint(3, 9)
    title = rng.choice([f"Understanding {concept}", f"{concept}: A Lesson for Grade {grade}"])
    n_goals = rng.randint(2, 4)
    goal_lines = [f"- Explain how {topic} affects {word(rng, 'nouns')}." for _ in range(n_goals)]
    goals = "\n".join(goal_lines)
    # stay on topic: every EDU sentence in this doc is about the same concept
    edu = [t.replace("{Concept}", concept).replace("{concept}", topic) for t in EDU]

    def section():  # some sections get a heading
        heading = "## " + fill(rng, "{Adj} {nouns}") + "\n" if rng.random() < 0.4 else ""
        return heading + para(rng, edu + GENERAL[:4])
    text = grow(rng, [title, "Learning objectives:\n" + goals], target, section)
    questions = []
    for i in range(1, 3):
        field = word(rng, "field")
        questions.append(f"{i}. What is {topic} and why does it matter in {field}?")
    return text + "\n\nReview questions:\n" + "\n".join(questions), title

# Math problems: each returns (question, solution steps, answer), computed exactly.
def p_add(rng):
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    da, db = str(a)[::-1], str(b)[::-1]  # digits, ones first
    carry = 0
    steps = []
    places = ["ones", "tens", "hundreds", "thousands"][:max(len(da), len(db))]
    for i, place in enumerate(places):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        plus_carry = f" + {carry}" if carry else ""
        write = f"write {s % 10} and carry 1." if s >= 10 else f"write {s}."
        steps.append(f"{place.capitalize()}: {x} + {y}{plus_carry} = {s}, " + write)
        carry = s // 10
    if carry:
        steps.append("Write the final carry 1 in front.")
    return f"Add {a} and {b}.", steps, str(a + b)

def p_mul(rng):
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    t, o = b - b % 10, b % 10  # tens and ones of b
    steps = [
        f"Split ${b} = {t} + {o}$.",
        f"${a} \\times {t} = {a * t}$ and ${a} \\times {o} = {a * o}$.",
        f"Add the partial products: ${a * t} + {a * o} = {a * b}$.",
    ]
    return f"Compute ${a} \\times {b}$.", steps, str(a * b)

def p_linear(rng):
    a = rng.randint(2, 12)
    x = rng.randint(-20, 20)  # the solution
    b = rng.choice([i for i in range(-30, 31) if i])  # nonzero: there is always a term to move
    c = a * x + b
    sb = f"+ {b}" if b > 0 else f"- {-b}"
    move = f"Subtract {b} from both sides" if b > 0 else f"Add {-b} to both sides"
    steps = [
        f"{move}: ${a}x = {c - b}$.",
        f"Divide both sides by {a}: $x = \\frac{{{c - b}}}{{{a}}} = {x}$.",
        f"Check: ${a} \\cdot ({x}) {sb} = {c}$.",
    ]
    return f"Solve ${a}x {sb} = {c}$.", steps, f"$x = {x}$"

def p_frac(rng):
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
    num, den = a * d + c * b, b * d
    g = math.gcd(num, den)
    a_scaled = f"$\\frac{{{a}}}{{{b}}} = \\frac{{{a * d}}}{{{den}}}$"
    c_scaled = f"$\\frac{{{c}}}{{{d}}} = \\frac{{{c * b}}}{{{den}}}$"
    total = f"$\\frac{{{num}}}{{{den}}}$"
    steps = [
        f"Use the common denominator ${b} \\cdot {d} = {den}$.",
        f"{a_scaled} and {c_scaled}.",
        f"Add the numerators: ${a * d} + {c * b} = {num}$, so the sum is {total}.",
    ]
    if g > 1:
        steps.append(f"Divide the numerator and the denominator by {g}.")
    ans = str(num // g) if den == g else f"$\\frac{{{num // g}}}{{{den // g}}}$"
    return f"Find $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$.", steps, ans

def p_quad(rng):
    r1, r2 = rng.sample([i for i in range(-9, 10) if i], 2)
    b, c = -(r1 + r2), r1 * r2

    def sgn(v, s=""):
        """The signed term v*s as " + 3x", " - x", " + 5"; empty when v is 0."""
        if v == 0:
            return ""
        sign = "+" if v > 0 else "-"
        coef = "" if abs(v) == 1 and s else abs(v)  # "x", not "1x"
        return f" {sign} {coef}{s}"
    eq = f"x^2{sgn(b, 'x')}{sgn(c)} = 0"
    lhs = eq.replace(" = 0", "")
    disc = b * b - 4 * c
    sqrt_disc = abs(r1 - r2)
    lo, hi = min(r1, r2), max(r1, r2)
    steps = [
        f"We need two numbers with product {c} and sum {b}: they are {-r1} and {-r2}.",
        f"So ${lhs} = (x{sgn(-r1)})(x{sgn(-r2)})$.",
        (f"Check with the discriminant: $\\Delta = b^2 - 4ac = {disc}$ "
         f"and $\\sqrt{{\\Delta}} = {sqrt_disc}$."),
        f"Each factor can be zero, so $x = {lo}$ or $x = {hi}$.",
    ]
    return f"Solve ${eq}$ by factoring.", steps, f"$x = {lo}, {hi}$"

def p_word(rng):
    kind = rng.randrange(4)
    name = word(rng, "name")
    if kind == 0:
        p = rng.randint(2, 15)
        bill = rng.choice([50, 100])
        n = rng.randint(2, (bill - 1) // p)
        item = word(rng, "foods")
        cost = n * p
        change = bill - cost
        question = (f"{name} buys {n} {item} for {p} dollars each "
                    f"and pays with a {bill}-dollar bill. How much change does {name} get?")
        steps = [
            f"The cost is ${n} \\times {p} = {cost}$ dollars.",
            f"The change is ${bill} - {cost} = {change}$ dollars.",
        ]
        return question, steps, f"{change} dollars"
    if kind == 1:
        v, t = rng.randrange(30, 95, 5), rng.randint(2, 6)
        question = f"A train travels at {v} km/h for {t} hours. How far does it go?"
        steps = [f"Distance equals speed times time: ${v} \\times {t} = {v * t}$."]
        return question, steps, f"{v * t} km"
    if kind == 2:
        y = rng.randrange(20, 420, 20)
        pct = rng.randrange(5, 100, 5)
        place = word(rng, "place")
        things = word(rng, "nouns")
        adj = word(rng, "adj")
        part = y * pct // 100
        question = f"A {place} has {y} {things}. {pct}% of them are {adj}. How many is that?"
        steps = [
            f"{pct}% means $\\frac{{{pct}}}{{100}}$.",
            f"$\\frac{{{pct}}}{{100}} \\times {y} = {part}$.",
        ]
        return question, steps, str(part)
    nums = [rng.randint(50, 100) for _ in range(rng.randint(3, 5))]
    nums[-1] += -sum(nums) % len(nums)  # make the mean an integer
    total = sum(nums)
    n = len(nums)
    mean = total // n
    question = f"{name} scored {', '.join(map(str, nums))} on {n} tests. What is the average score?"
    steps = [
        f"The sum is ${' + '.join(map(str, nums))} = {total}$.",
        f"Divide by {n}: ${total} \\div {n} = {mean}$.",
    ]
    return question, steps, str(mean)

MATH = {
    "addition": p_add,
    "multiplication": p_mul,
    "linear equations": p_linear,
    "fractions": p_frac,
    "quadratic equations": p_quad,
    "word problems": p_word,
}

def math_doc(rng, target):
    # a few topics per page keeps docs coherent
    topics = rng.sample(sorted(MATH), rng.randint(1, 3))
    title_starts = ["Worked examples: ", "Practice problems with solutions: ", "Homework help: "]
    title = rng.choice(title_starts) + " and ".join(topics)
    medium = rng.choice(["lesson", "post", "worksheet"])
    intro = (f"In this {medium} we work through {' and '.join(topics)} "
             "step by step. Try each one before reading the solution.")
    blocks = [title, intro]
    k = 0  # problem number

    def problem():
        nonlocal k
        k += 1
        q, steps, ans = MATH[rng.choice(topics)](rng)
        return f"Problem {k}. {q}\n\nSolution.\n" + "\n".join(steps) + f"\n\nAnswer: {ans}"
    return grow(rng, blocks, target, problem), title

# ---------------------------------------------------------------- sources
def make_docs(seed, gen, budget_chars):
    rng = random.Random(seed)
    docs = []
    total = 0
    while total < budget_chars:
        # log-uniform: tens..thousands of words
        target = int(math.exp(rng.uniform(math.log(20), math.log(2500))))
        text, title = gen(rng, target)
        slug = "-".join(regex.findall(r"\w+", title.lower()))
        url = f"https://www.{word(rng, 'site')}.com/{slug}"
        # the rng travels with the doc: row metadata is drawn from it later, still in a fixed order
        docs.append({"text": text, "rng": rng, "url": url})
        total += len(text)
    return docs

def stamp(r, year, days=365):
    offset = timedelta(seconds=r.randrange(days * 86400))
    t = datetime(year, 1, 1, tzinfo=timezone.utc) + offset
    return t, t.strftime("%Y-%m-%dT%H:%M:%SZ")

def warc(r, crawl, seg):
    return (f"crawl-data/{crawl}/segments/{seg}{r.randrange(10**6):06d}.{r.randrange(100)}/warc/"
            f"{crawl}-{r.randrange(10**6):06d}-{r.randrange(10**5):05d}.warc.gz")

# Row builders: column names and order follow the real datasets; Python int/float/str become
# int64/double/string in parquet. Dict values are evaluated in order, so each row draws from
# its doc's rng top to bottom.
def c4_row(d, i):
    return {"text": d["text"], "timestamp": stamp(d["rng"], 2019)[1], "url": d["url"]}

def dclm_row(d, i):
    r = d["rng"]
    feats = {
        "fasttext_score": round(r.uniform(0.02, 0.9), 4),
        "quality_score": round(r.uniform(0.5, 1), 4),
    }
    return {
        "nemo_id": f"{r.randrange(10**6):06d}-{i}",
        "text": d["text"],
        "source": "dclm",
        "filtering_features": json.dumps(feats),
        "source_other": json.dumps({"url": d["url"], "language": "en"}),
    }

def fwe_row(d, i):
    r = d["rng"]
    score = round(r.uniform(3, 5), 6)
    return {
        "text": d["text"],
        "id": f"<urn:uuid:{uuid.UUID(int=r.getrandbits(128), version=4)}>",
        "dump": "CC-MAIN-2023-50",
        "url": d["url"],
        "date": stamp(r, 2023)[1],
        "file_path": "s3://commoncrawl/" + warc(r, "CC-MAIN-2023-50", "1700679"),
        "language": "en",
        "language_score": round(r.uniform(0.85, 1), 6),
        "token_count": d["tokens"],
        "score": score,
        "int_score": round(score),
    }

def math_row(d, i):
    r = d["rng"]
    score = round(r.uniform(3, 5), 6)
    return {
        "url": d["url"],
        "fetch_time": int(stamp(r, 2024, 60)[0].timestamp()),
        "content_mime_type": "text/html",
        "warc_filename": warc(r, "CC-MAIN-2024-10", "1707947"),
        "warc_record_offset": r.randrange(10**9),
        "warc_record_length": r.randrange(5000, 90000),
        "text": d["text"],
        "token_count": d["tokens"],
        "char_count": len(d["text"]),
        "metadata": json.dumps({"extraction": "synthetic", "has_latex": "$" in d["text"]}),
        "score": score,
        "int_score": round(score),
        "crawl": "CC-MAIN-2024-10",
        "snapshot_type": r.choice(["latest", "largest"]),
        "language": "en",
        "language_score": round(r.uniform(0.85, 1), 6),
    }

# name: (seed, doc generator, chars of text, row builder, output files)
# Shards of one source get equal doc counts.
TWO = "train-0000{}-of-00002.parquet"
C4_FILES = [
    "c4/en/c4-train.00000-of-00002.json.gz",
    "c4/en/c4-train.00001-of-00002.json.gz",
    "c4/en/c4-validation.00000-of-00001.json.gz",
]
DCLM_FILES = ["zyda2/data/dclm_crossdeduped/" + TWO.format(k) for k in (0, 1)]
FWE_FILES = ["zyda2/data/fwe3/" + TWO.format(k) for k in (0, 1)]
MATH_FILES = ["finemath/finemath-3plus/" + TWO.format(k) for k in (0, 1)]
SOURCES = {
    "c4": (1, c4_doc, 2_100_000, c4_row, C4_FILES),
    "zyda2/dclm_crossdeduped": (2, dclm_doc, 750_000, dclm_row, DCLM_FILES),
    "zyda2/fwe3": (3, fwe_doc, 750_000, fwe_row, FWE_FILES),
    "finemath": (4, math_doc, 1_000_000, math_row, MATH_FILES),
}
# Held-out slices for validation (c4 has its own split above): new documents from their own
# seeds, made after everything else so the training files and the tokenizer (trained on
# training text only) are unchanged, and kept outside the training globs.
# name: (seed, chars of text, output file)
def heldout_file(name):
    """zyda2/fwe3 -> zyda2/validation/fwe3/validation-00000-of-00001.parquet"""
    dataset, component = name.split("/")[0], name.split("/")[-1]
    return f"{dataset}/validation/{component}/validation-00000-of-00001.parquet"

HELDOUT = {name: (100 + SOURCES[name][0], 40_000, heldout_file(name))
           for name in ("zyda2/dclm_crossdeduped", "zyda2/fwe3")}
MATH_HELDOUT = "finemath/validation/finemath-3plus/validation-00000-of-00001.parquet"
HELDOUT["finemath"] = (104, 40_000, MATH_HELDOUT)

# ---------------------------------------------------------------- tokenizer
def train_bpe(texts, n_tokens):
    """Byte-level BPE on unique pre-token counts. Ranks: bytes 0..255, then merges in creation
    order, which is exactly what tiktoken's lowest-rank-first merging expects."""
    counts = Counter(tok for t in texts for tok in regex.findall(PAT, t))
    words = [[bytes([b]) for b in w.encode()] for w in counts]  # insertion order => deterministic
    freqs = list(counts.values())
    vocab = [bytes([b]) for b in range(256)]
    known = set(vocab)
    pairs = Counter()  # adjacent pair -> total count over all words
    where = defaultdict(set)  # adjacent pair -> indices of the words that contain it
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freqs[i]
            where[p].add(i)
    while len(vocab) < n_tokens:
        top = max(pairs.values())
        a, b = min(p for p, c in pairs.items() if c == top)  # ties: smallest byte pair
        if a + b not in known:  # an equal token may exist via another split; never emit duplicates
            vocab.append(a + b)
            known.add(a + b)
        for i in where.pop((a, b)):
            w, f = words[i], freqs[i]
            for p in zip(w, w[1:]):
                pairs[p] -= f
                if not pairs[p]:
                    del pairs[p]
            out = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            for p in zip(out, out[1:]):
                pairs[p] += f
                where[p].add(i)
            words[i] = out
    return vocab

# ---------------------------------------------------------------- main
def main():
    t0 = time.time()
    for sub in ("data", "tokenizer"):  # start clean so stale files never survive a regeneration
        shutil.rmtree(os.path.join(ROOT, sub), ignore_errors=True)
    docs = {name: make_docs(seed, gen, chars) for name, (seed, gen, chars, _, _) in SOURCES.items()}

    vocab = train_bpe([d["text"] for ds in docs.values() for d in ds], N_BPE)
    tok_path = os.path.join(ROOT, "tokenizer", "tokenizer.model")
    os.makedirs(os.path.dirname(tok_path))
    blob = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(vocab)).encode()
    with open(tok_path, "wb") as f:
        f.write(blob)
    # tiktoken caches even local files, keyed by *path*, in /tmp/data-gym-cache: bypass it so we
    # neither read back a stale copy nor leave one behind
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    ranks = load_tiktoken_bpe(tok_path)
    assert ranks == {t: r for r, t in enumerate(vocab)}
    assert sorted(ranks.values()) == list(range(N_BPE))
    assert all(ranks[bytes([b])] == b for b in range(256))
    special = {"<|begin_of_text|>": N_BPE, "<|end_of_text|>": N_BPE + 1}
    enc = tiktoken.Encoding(name="llama3-sample", pat_str=PAT, mergeable_ranks=ranks,
                            special_tokens=special)

    table = []
    for name, (_, _, _, row_fn, files) in SOURCES.items():
        ds = docs[name]
        for d in ds:
            ids = enc.encode_ordinary(d["text"])
            assert enc.decode(ids) == d["text"], "tokenizer round trip failed"
            d["tokens"] = len(ids)
        rows = [row_fn(d, i) for i, d in enumerate(ds)]
        cuts = [0, len(rows) // 2, len(rows)]
        if name == "c4":  # ~5% validation, the rest in two train shards
            cuts = [0, len(rows) * 19 // 40, len(rows) * 19 // 20, len(rows)]
        for k, rel in enumerate(files):
            path = os.path.join(ROOT, "data", rel)
            part = rows[cuts[k]:cuts[k + 1]]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if path.endswith(".json.gz"):
                # mtime=0 and no file name in the header: reproducible gzip
                lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part).encode()
                with open(path, "wb") as f:
                    f.write(gzip.compress(lines, compresslevel=9, mtime=0))
            else:
                pq.write_table(pa.Table.from_pylist(part), path, compression="zstd")
        nbytes = sum(len(d["text"].encode()) for d in ds)
        ntok = sum(d["tokens"] for d in ds)
        words = sum(len(d["text"].split()) for d in ds)
        ratio = nbytes / ntok
        table.append(f"| {name} | {len(ds)} | {words:,} | {nbytes:,} | {ntok:,} | {ratio:.2f} |")
        print(table[-1])

    for name, (seed, chars, rel) in HELDOUT.items():
        _, gen, _, row_fn, _ = SOURCES[name]
        ds = make_docs(seed, gen, chars)
        for d in ds:
            d["tokens"] = len(enc.encode_ordinary(d["text"]))
        path = os.path.join(ROOT, "data", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rows = [row_fn(d, i) for i, d in enumerate(ds)]
        pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd")
        print(f"held out: {rel}: {len(ds)} docs, {sum(d['tokens'] for d in ds):,} tokens")

    readme = README.replace("{n}", str(N_BPE)).replace("{v}", str(N_BPE + 256))
    readme = readme.replace("{table}", "\n".join(table))
    with open(os.path.join(ROOT, "README.md"), "w") as f:
        f.write(readme)
    print(f"done in {time.time() - t0:.1f}s")

README = """# Bundled assets

Generated by `python assets/make_assets.py` (offline and deterministic: re-running it rewrites
identical bytes); do not edit by hand. The text is synthetic (word lists and templates in the
script), so it is free to redistribute. It is meant for tests and smoke runs: repetitive enough
that a small model learns it within a few dozen steps.

- `data/c4/en/c4-train.0000{0,1}-of-00002.json.gz`, `data/c4/en/c4-validation.00000-of-00001.json.gz`:
  layout of `allenai/c4` `en` (gzipped JSON lines: `text`, `timestamp`, `url`).
- `data/zyda2/data/{dclm_crossdeduped,fwe3}/train-0000{0,1}-of-00002.parquet`: after `Zyphra/Zyda-2`;
  the components have different schemas, as in the real one (`nemo_id, text, source,
  filtering_features, source_other` vs FineWeb-Edu's `text, id, dump, url, date, file_path,
  language, language_score, token_count, score, int_score`).
- `data/finemath/finemath-3plus/train-0000{0,1}-of-00002.parquet`: layout and 16 columns of
  `HuggingFaceTB/finemath` `finemath-3plus`; worked math problems with exactly computed answers.
- Held-out slices for validation, same schemas, about 40,000 characters each, made from their own seeds
  after the training files (which they leave unchanged) and outside the training globs:
  `data/zyda2/validation/{dclm_crossdeduped,fwe3}/validation-00000-of-00001.parquet`,
  `data/finemath/validation/finemath-3plus/validation-00000-of-00001.parquet`; C4's is
  `data/c4/en/c4-validation.00000-of-00001.json.gz` (5% of its documents; unlike the other slices,
  the tokenizer was trained on it too).
- `tokenizer/tokenizer.model`: {n}-token byte-level BPE in Llama 3's tiktoken format (`base64(token) rank`
  per line, ranks 0-255 = single bytes), trained on this text with Llama 3's pre-tokenizer regex.
  With Llama 3's 256 special tokens appended (`<|begin_of_text|>` = {n}, ...) the vocab is {v}.

Token counts with the bundled tokenizer (no special tokens):

| source | docs | words | bytes | tokens | bytes/token |
|---|---|---|---|---|---|
{table}
"""

if __name__ == "__main__":
    main()
