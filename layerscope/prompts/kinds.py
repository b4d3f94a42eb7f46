"""Kinds of conversation, told from the first user turn, and weights that draw them (train-draft --kinds).

kind_of(text) -> one of KINDS. It is a cheap, deterministic guess from the words of the whole request
(sets of whole words and a few regular expressions over the lower-cased text), not a model. What copying
a ShareGPT page left at the end of a turn is removed first (the "지금 번역하기" / "Translate now" button of
a translation extension, a "1 / 1" page counter). Then the first rule that matches decides:

1. summarization: a request for a summary: summarize / summarise in any form, "sum up", "tl;dr" / "tldr",
   "a / the / short / brief / concise / quick / executive summary", or 总结 總結 摘要 要約 요약 zusammenfass-.
2. translation: a translate word (translate, translation, traduire / traduis, traduce / traducir / traduza,
   übersetz-, перевед- / перевод, 翻译 翻譯 翻訳, 번역), unless the text names a programming language and no
   natural one ("translate this Python to Java" is code); or "in / into / to <a language>" closing a
   clause ("Say it in French.", "into Spanish:"), where English counts only after into / to: "in English"
   and "Please write in Korean language" (a line ShareGPT's tools append to any request) name the
   answer's language, not a translation.
3. code: a ``` fence; code syntax (a line starting def f(...): / class ...: / import / from ... import /
   #include / function f( / SELECT ... FROM, a line ending in {, a call like math.sqrt(, a snake_case
   name, an error name like TypeError); or a programming word (python, javascript, sql, html, css, code,
   coding, programming, debug, compile, api, regex, git, docker, json, script, traceback, ...).
4. math: arithmetic ("12 * 7", "3+4", "2x + 3 = 7", "x^2"), a math sign (√ ∫ ∑ π ≤ ≥ ≠), or a math
   word (equation, integral, derivative, calculus, algebra, arithmetic, polynomial, calculate, math;
   "solve" followed by a digit in its sentence, "solve for").
5. chat: everything else.

Summarization and translation come first because they ask for something done to a text that may itself
be code or numbers ("summarize this code" is summarization, "translate to French: ```...```" translation);
code comes before math because programs are full of arithmetic. The kind is about the request, not the
language it is written in: a question in Chinese is chat unless a rule matches. On the packaged ShareGPT
file's 17,395 first user turns (rules of VERSION 1): 12,354 chat, 4,288 code, 391 summarization, 210 math,
152 translation.

Weights (parse_weights): "code=2,translation=2,math=0" -> a weight per kind, how many times more often a
conversation of that kind is drawn than one of weight 1; a kind not named keeps weight 1, "*=W" sets the
weight of every kind not named (so "code=1,*=0" keeps code only), 0 leaves a kind out.
weighted_order(kinds, weights, seed) is the order such a draw takes.
"""

from __future__ import annotations

import math
import random
import re

from layerscope.errors import LayerScopeError, PromptSetError
from layerscope.validate import check_number

KINDS = ("code", "translation", "summarization", "math", "chat")
VERSION = 1     # bump when a rule changes: stored kinds of ShareGPT records are kept under it (prompts/sharegpt.py)

WORD = re.compile(r"\w+(?:\+\+|#)?")                      # the words of the text; c++ and c# keep their signs
RESIDUE = re.compile(r"(?:지금 번역하기|translate now|\d+ / \d+)\s*$")   # what copying a ShareGPT page left at the end

SUMMARY_WORDS = {"summarize", "summarise", "summarizes", "summarises", "summarized", "summarised", "summarizing",
                 "summarising", "summarization", "summarisation", "tldr"}
SUMMARY_STEMS = ("tl;dr", "tl; dr", "总结", "總結", "摘要", "要約", "요약", "zusammenfass")
SUM_UP = re.compile(r"\bsum(?:s|med|ming)? (?:it |this |that |them )?up\b")
A_SUMMARY = re.compile(r"\b(?:a|an|the|short|brief|concise|quick|executive)\s+summary\b")

TRANSLATE_WORDS = {"translate", "translates", "translated", "translating", "translation", "translations", "traduire",
                   "traduis", "traduisez", "traduce", "traducir", "traduza", "traduzir"}
TRANSLATE_STEMS = ("übersetz", "перевед", "перевод", "翻译", "翻譯", "翻訳", "번역")
NATURAL = {"english", "french", "spanish", "german", "italian", "portuguese", "chinese", "mandarin", "cantonese",
           "japanese", "korean", "russian", "arabic", "hindi", "bengali", "urdu", "dutch", "swedish", "norwegian",
           "danish", "finnish", "polish", "czech", "turkish", "greek", "hebrew", "vietnamese", "thai", "indonesian",
           "malay", "persian", "farsi", "ukrainian", "romanian", "hungarian", "tagalog", "swahili"}
IN_LANGUAGE = re.compile(r"\b(?:in|into|to)\s+(?:%s)\s*(?:[.?!:;,)\n]|$)|\b(?:into|to)\s+english\s*(?:[.?!:;,)\n]|$)"
                         % "|".join(sorted(NATURAL - {"english"})))

PROGRAMMING = {"python", "java", "javascript", "js", "typescript", "c++", "c#", "golang", "rust", "ruby", "php",
               "kotlin", "scala", "perl", "matlab", "sql", "html", "css", "bash", "powershell", "vba", "solidity",
               "swiftui", "react", "nodejs"}
CODE_WORDS = PROGRAMMING | {"code", "coding", "programming", "programmer", "debug", "debugging", "compile", "compiler",
                            "api", "regex", "git", "github", "docker", "kubernetes", "json", "yaml", "numpy", "pandas",
                            "pytorch", "tensorflow", "django", "flask", "script", "traceback"}
CODE_LINE = re.compile(r"^[ \t]*(?:def\s+\w+\s*\(.*\)\s*(?:->.*)?:|class\s+\w+.*:|import\s+[\w.]+|from\s+[\w.]+\s+import\b"
                       r"|#include\b|function\s*\w*\s*\(|select\s.+\sfrom\s)", re.MULTILINE)
CODE_LINE_WORDS = {"def", "class", "import", "include", "function", "select"}
CALL = re.compile(r"\w\.\w+\(")                            # math.sqrt(
SNAKE = re.compile(r"[a-z]\\?_[a-z]")                       # snake_case (ShareGPT often writes it snake\_case)
ERROR_NAME = re.compile(r"\w(?:Error|Exception)\b")         # TypeError, NullPointerException: case-sensitive

ARITHMETIC = re.compile(r"\d\s*[+*×÷^]\s*\(?-?\d|[a-z]\s*\^\s*\d|\d[a-z]\s*[-+]\s*\d+\s*=")
MATH_SIGNS = "√∫∑π≤≥≠"
MATH_WORDS = {"equation", "equations", "integral", "integrals", "derivative", "derivatives", "calculus", "algebra",
              "algebraic", "arithmetic", "polynomial", "polynomials", "calculate", "math", "maths", "mathematics"}
SOLVE = re.compile(r"\bsolve\s+for\b|\bsolve\b[^.?!\n]*\d")


def kind_of(text: str) -> str:
    """The kind of a request (the first user turn of a conversation): the first rule of the docstring that matches."""
    t = request(text)
    words = set(WORD.findall(t))
    if is_summarization(t, words):
        return "summarization"
    if is_translation(t, words):
        return "translation"
    if is_code(t, words, str(text)):
        return "code"
    if is_math(t, words):
        return "math"
    return "chat"


def request(text: str) -> str:
    """The text the rules read: lower case, without the residue of copying a ShareGPT page at its end (the
    "지금 번역하기" / "Translate now" button of a translation extension, a "1 / 1" page counter)."""
    t = str(text).lower().rstrip()
    while (m := RESIDUE.search(t, max(0, len(t) - 40))) is not None:
        t = t[: m.start()].rstrip()
    return t


def is_summarization(t: str, words: set[str]) -> bool:
    return bool(words & SUMMARY_WORDS or any(s in t for s in SUMMARY_STEMS)
                or (words & {"sum", "sums", "summed", "summing"} and SUM_UP.search(t))
                or ("summary" in words and A_SUMMARY.search(t)))


def is_translation(t: str, words: set[str]) -> bool:
    languages = words & NATURAL
    asked = words & TRANSLATE_WORDS or any(s in t for s in TRANSLATE_STEMS)
    return bool((asked and (languages or not words & PROGRAMMING)) or (languages and IN_LANGUAGE.search(t)))


def is_code(t: str, words: set[str], text: str) -> bool:
    return bool("```" in t or words & CODE_WORDS or (words & CODE_LINE_WORDS and CODE_LINE.search(t))
                or ("{" in t and re.search(r"\{[ \t]*$", t, re.MULTILINE)) or ("(" in t and CALL.search(t))
                or ("_" in t and SNAKE.search(t)) or (("rror" in text or "xception" in text) and ERROR_NAME.search(text)))


def is_math(t: str, words: set[str]) -> bool:
    return bool(words & MATH_WORDS or any(c in t for c in MATH_SIGNS)
                or (any(c in t for c in "+*×÷^") and ARITHMETIC.search(t)) or ("solve" in words and SOLVE.search(t)))


def parse_weights(spec: str, *, error: type[LayerScopeError] = PromptSetError, flag: str = "--kinds") -> dict[str, float]:
    """'code=2,math=0,*=1' -> {kind: weight} for every kind of KINDS (the module docstring says the syntax);
    raises error(problem, fix) on an unknown kind, a kind named twice, a bad weight, or no weight above 0."""
    fix = f"Write {flag} like code=2,translation=2,math=0 (kinds: {', '.join(KINDS)}; *=W for the rest)"
    named, rest = {}, 1.0
    for part in str(spec).split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not name:
            raise error(f"{flag} {spec!r}: {part.strip()!r} is not KIND=WEIGHT", fix)
        if name not in (*KINDS, "*"):
            raise error(f"{flag} {spec!r}: {name!r} is not a kind", fix)
        if name in named:
            raise error(f"{flag} {spec!r} names {name} twice", fix)
        try:
            weight = float(value)
        except ValueError:
            raise error(f"{flag} {spec!r}: the weight of {name} must be a number (got {value!r})", fix) from None
        named[name] = check_number(f"{flag} weight of {name}", weight, minimum=0, error=error, fix=fix)
    rest = named.pop("*", rest)
    weights = {k: named.get(k, rest) for k in KINDS}
    if not any(w > 0 for w in weights.values()):
        raise error(f"{flag} {spec!r} leaves every kind out", "Give at least one kind a weight above 0")
    return weights


def canonical(weights: dict[str, float]) -> str:
    """The one spelling of a weighting, every kind in KINDS order: 'code=2,translation=1,...' (store keys use it)."""
    return ",".join(f"{k}={weights[k]:g}" for k in KINDS)


def weighted_order(kinds: list[str], weights: dict[str, float], seed: int) -> list[int]:
    """Indices of the items whose kind has weight > 0, in the order of a seeded weighted draw without
    replacement: an item of weight w comes next with probability w / (the weights of the items left).

    Efraimidis and Spirakis' keys log(u) / w, largest first, where u is the item's place in a seeded shuffle
    (random.Random(seed).shuffle, the one prompts/sets.py draws with), spread evenly over (0, 1) instead
    of drawn. So equal weights give exactly that shuffle's order, a kind of weight 0 is taken out of it
    without moving the rest, and any limit takes a prefix of the same order."""
    n = len(kinds)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    keys = {}
    for place, i in enumerate(order):
        w = weights[kinds[i]]
        if w > 0:
            keys[i] = math.log(1 - (place + 0.5) / n) / w
    return sorted(keys, key=lambda i: -keys[i])
