"""Observer names that cannot pass for others.

A name is kept in NFC (``é`` typed as one character or as ``e`` + accent is one name). Refused:
characters that show nothing or steer text rather than show (``refusal``): controls, format
characters (zero-width space and joiners, soft hyphen, the byte order mark, bidi controls …),
line and paragraph separators, and the other default-ignorable code points (variation
selectors, Hangul fillers …). Two live observers may not have names that look alike: each name
has a *key* (``name_key``), its NFKC form case-folded with the Cyrillic and Greek letters that
look like Latin ones written as those (``paypal`` typed with a Cyrillic small a is ``paypal``),
and keys are unique among observers that are not deleted, as names are.

The look-alike table is written here rather than taken from a package: what PyPI has is either
the data without a skeleton (``confusable-homoglyphs``: symmetric homoglyph lists), a list of
candidate spellings rather than one key (``confusables``), or a compiled ICU binding
(``PyICU``'s spoof checker, UTS #39 proper), which would need ICU and a compiler in every
image for some sixty letters. ASCII is left as it is (``l`` and ``1``, ``O`` and ``0``, ``rn``
and ``m`` stay distinct names), as are letters of other scripts.
"""

from __future__ import annotations

import unicodedata

#: Code points a name may not hold, as ranges: Unicode categories Cc, Cf, Zl and Zp, and the
#: default-ignorable code points (``tests/unit/test_names.py`` checks it against the Unicode
#: database this Python has).
REFUSED_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x001F),
    (0x007F, 0x009F),
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x2028, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
#: The same as the inside of a regex character class, the ranges below U+10000 only (what a
#: JSON Schema pattern can say everywhere): the API's name pattern. ``refusal`` checks all.
REFUSED_CLASS = "".join(
    f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in REFUSED_RANGES if b <= 0xFFFF
)
_BIDI = frozenset((0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)))


def _refused(code: int) -> bool:
    return any(a <= code <= b for a, b in REFUSED_RANGES)


def _what(ch: str) -> str:
    code = ord(ch)
    category = unicodedata.category(ch)
    if code in _BIDI:
        return "a bidi control character"
    if category == "Cc":
        return "a control character"
    if category in ("Zl", "Zp"):
        return "a line or paragraph separator"
    if category == "Cf":
        return "a format character (invisible)"
    return "an invisible (default-ignorable) character"


def refusal(name: str) -> str | None:
    """Why ``name`` cannot be an observer's name (the character's class, code point and
    position, never the name), or None."""
    for i, ch in enumerate(name):
        if _refused(ord(ch)):
            return f"must not contain {_what(ch)} (U+{ord(ch):04X} at position {i})"
    return None


def normal(name: str) -> str:
    """The name as it is kept: NFC."""
    return unicodedata.normalize("NFC", name)


#: Cyrillic and Greek letters (either case) that look like a Latin letter, as that letter
#: (escaped: this file shows none of them).
_LOOK_ALIKES = {
    "\u0410": "A",  # cyrillic capital letter a
    "\u0412": "B",  # cyrillic capital letter ve
    "\u0415": "E",  # cyrillic capital letter ie
    "\u0417": "3",  # cyrillic capital letter ze
    "\u0405": "S",  # cyrillic capital letter dze
    "\u0406": "I",  # cyrillic capital letter byelorussian-ukrainian i
    "\u0408": "J",  # cyrillic capital letter je
    "\u041a": "K",  # cyrillic capital letter ka
    "\u041c": "M",  # cyrillic capital letter em
    "\u041d": "H",  # cyrillic capital letter en
    "\u041e": "O",  # cyrillic capital letter o
    "\u0420": "P",  # cyrillic capital letter er
    "\u0421": "C",  # cyrillic capital letter es
    "\u0422": "T",  # cyrillic capital letter te
    "\u0423": "Y",  # cyrillic capital letter u
    "\u0425": "X",  # cyrillic capital letter ha
    "\u04ae": "Y",  # cyrillic capital letter straight u
    "\u04ba": "H",  # cyrillic capital letter shha
    "\u04c0": "l",  # cyrillic letter palochka
    "\u051a": "Q",  # cyrillic capital letter qa
    "\u051c": "W",  # cyrillic capital letter we
    "\u042c": "b",  # cyrillic capital letter soft sign
    "\u0430": "a",  # cyrillic small letter a
    "\u0435": "e",  # cyrillic small letter ie
    "\u043e": "o",  # cyrillic small letter o
    "\u0440": "p",  # cyrillic small letter er
    "\u0441": "c",  # cyrillic small letter es
    "\u0443": "y",  # cyrillic small letter u
    "\u0445": "x",  # cyrillic small letter ha
    "\u0455": "s",  # cyrillic small letter dze
    "\u0456": "i",  # cyrillic small letter byelorussian-ukrainian i
    "\u0458": "j",  # cyrillic small letter je
    "\u04bb": "h",  # cyrillic small letter shha
    "\u04cf": "l",  # cyrillic small letter palochka
    "\u051b": "q",  # cyrillic small letter qa
    "\u051d": "w",  # cyrillic small letter we
    "\u04af": "y",  # cyrillic small letter straight u
    "\u0501": "d",  # cyrillic small letter komi de
    "\u0475": "v",  # cyrillic small letter izhitsa
    "\u0391": "A",  # greek capital letter alpha
    "\u0392": "B",  # greek capital letter beta
    "\u0395": "E",  # greek capital letter epsilon
    "\u0396": "Z",  # greek capital letter zeta
    "\u0397": "H",  # greek capital letter eta
    "\u0399": "I",  # greek capital letter iota
    "\u039a": "K",  # greek capital letter kappa
    "\u039c": "M",  # greek capital letter mu
    "\u039d": "N",  # greek capital letter nu
    "\u039f": "O",  # greek capital letter omicron
    "\u03a1": "P",  # greek capital letter rho
    "\u03a4": "T",  # greek capital letter tau
    "\u03a5": "Y",  # greek capital letter upsilon
    "\u03a7": "X",  # greek capital letter chi
    "\u03f9": "C",  # greek capital lunate sigma symbol
    "\u037f": "J",  # greek capital letter yot
    "\u03b1": "a",  # greek small letter alpha
    "\u03b9": "i",  # greek small letter iota
    "\u03ba": "k",  # greek small letter kappa
    "\u03bd": "v",  # greek small letter nu
    "\u03bf": "o",  # greek small letter omicron
    "\u03c1": "p",  # greek small letter rho
    "\u03c5": "u",  # greek small letter upsilon
    "\u03c7": "x",  # greek small letter chi
    "\u03b3": "y",  # greek small letter gamma
    "\u03f2": "c",  # greek lunate sigma symbol
    "\u03f3": "j",  # greek letter yot
    "\u0251": "a",  # latin small letter alpha
    "\u0261": "g",  # latin small letter script g
    "\u0131": "i",  # latin small letter dotless i
    "\u0237": "j",  # latin small letter dotless j
    "\u0269": "i",  # latin small letter iota
    "\u01c0": "l",  # latin letter dental click
    "\u1d00": "a",  # latin letter small capital a
    "\u0299": "b",  # latin letter small capital b
    "\u1d04": "c",  # latin letter small capital c
    "\u1d05": "d",  # latin letter small capital d
    "\u1d07": "e",  # latin letter small capital e
    "\u0262": "g",  # latin letter small capital g
    "\u029c": "h",  # latin letter small capital h
    "\u026a": "i",  # latin letter small capital i
    "\u1d0a": "j",  # latin letter small capital j
    "\u1d0b": "k",  # latin letter small capital k
    "\u029f": "l",  # latin letter small capital l
    "\u1d0d": "m",  # latin letter small capital m
    "\u0274": "n",  # latin letter small capital n
    "\u1d0f": "o",  # latin letter small capital o
    "\u1d18": "p",  # latin letter small capital p
    "\u0280": "r",  # latin letter small capital r
    "\ua731": "s",  # latin letter small capital s
    "\u1d1b": "t",  # latin letter small capital t
    "\u1d1c": "u",  # latin letter small capital u
    "\u1d20": "v",  # latin letter small capital v
    "\u1d21": "w",  # latin letter small capital w
    "\u028f": "y",  # latin letter small capital y
    "\u1d22": "z",  # latin letter small capital z
    "\u0585": "o",  # armenian small letter oh
    "\u057d": "u",  # armenian small letter seh
    "\u0570": "h",  # armenian small letter ho
    "\u0578": "n",  # armenian small letter vo
    "\u0581": "g",  # armenian small letter co
    "\u13aa": "A",  # cherokee letter go
    "\u13f4": "B",  # cherokee letter yv
    "\u13df": "C",  # cherokee letter tli
    "\u13ac": "E",  # cherokee letter gv
    "\u13c0": "G",  # cherokee letter nah
    "\u13bb": "H",  # cherokee letter mi
    "\u13b7": "M",  # cherokee letter lu
    "\u13d2": "R",  # cherokee letter sv
    "\u13da": "S",  # cherokee letter du
    "\u13a2": "T",  # cherokee letter i
    "\ua4d0": "B",  # lisu letter ba
    "\ua4d1": "P",  # lisu letter pa
    "\ua4d3": "D",  # lisu letter da
    "\ua4f0": "E",  # lisu letter e
    "\ua4f2": "I",  # lisu letter i
    "\ua4e1": "L",  # lisu letter la
    "\ua4e0": "N",  # lisu letter na
    "\ua4f3": "O",  # lisu letter o
    "\ua4ea": "W",  # lisu letter wa
}
_TABLE = str.maketrans(_LOOK_ALIKES)


def name_key(name: str) -> str:
    """What two names that look alike share: NFKC (fullwidth letters are ASCII ones, the
    ``fi`` ligature is ``fi``), case folded, the look-alike letters as Latin (before folding,
    so that a capital and a small letter are each read as what they look like, and after,
    for letters that folding made)."""
    folded = unicodedata.normalize("NFKC", name).translate(_TABLE).casefold()
    return unicodedata.normalize("NFKC", folded.translate(_TABLE))
