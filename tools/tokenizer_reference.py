#!/usr/bin/env python3
"""Golden token ids for lily-tokenizer, from the Hugging Face reference implementations.

Encodes a hand-written multilingual + code corpus (below) with the Python `tokenizers` library on
the real Qwen3.5/3.6 `tokenizer.json`, cross-checks every piece against transformers'
`AutoTokenizer` (the path a checkpoint directory takes), and writes

    crates/lily-tokenizer/tests/data/golden.json
        {"tokenizers": VERSION, "transformers": VERSION, "vocab_size": N,
         "pieces": [{"name": ..., "text": ..., "ids": [...],
                     "decoded": ...,               # only where decode(ids) != text (NFC)
                     "decoded_skip_special": ...   # only where it differs from decode(ids)
                    }, ...]}
    (the hand-written pieces, then 150 seeded random strings `random_NNN`)
    crates/lily-tokenizer/tests/data/tokenizer_config.json
        a Qwen-style tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, bos null,
        added_tokens_decoder copied from tokenizer.json); used for the transformers cross-check
        and by the Rust tests of the config parser.

Encoding is `add_special_tokens=False` (Qwen adds no BOS; there is no post-processor anyway):
special and added tokens written in the text (`<|im_start|>`, `<think>`, ...) become single ids.

    python3 tools/tokenizer_reference.py [--tokenizer assets/qwen3.6-tokenizer.json.gz] [--out-dir DIR]

Checking the `lily tokenize` CLI instead (writes nothing): every hand-written piece (and the random
ones joined into one text, or the paragraphs of --corpus FILE) goes through
`lily tokenize --model DIR` (text on stdin -> JSON ids) and `lily tokenize --model DIR --decode`
(JSON ids on stdin -> text, compared byte for byte, no added newline) against the reference:

    python3 tools/tokenizer_reference.py --lily target/release/lily [--model CHECKPOINT_DIR] [--corpus FILE]

Without --model, a temporary directory with the tokenizer.json and the Qwen-style
tokenizer_config.json stands in for the checkpoint.

Pinned versions (tools/requirements-reference.txt): tokenizers 0.23.3, transformers 5.24.0.
The corpus is written for this test: it is not in any training or tokenizer-building corpus we used.
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import tokenizers

ROOT = Path(__file__).resolve().parent.parent

RENDERED_CHAT = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call>\n\nYou are Lily, a terse assistant.<|im_end|>\n"
    "<|im_start|>user\nWat is het weer in Utrecht? 🌧️<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user asks (in Dutch) about the weather; call the tool.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nUtrecht\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp_c\": 11.5, \"sky\": \"motregen\"}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)

# (name, text). Hand-written for this test; keep every piece short.
CORPUS = [
    # README known ids (tokenizer/qwen3.6/README.md)
    ("readme_known_1", "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"),
    ("readme_known_2", "<|im_start|>user\nhi<|im_end|>\n<think>\n"),
    # prose
    ("english_prose",
     "The lighthouse keeper's daughter counted ships the way other children counted sheep: slowly, "
     "with great suspicion, and never quite reaching the end. On the 3rd of March, 1911, she logged "
     "forty-two vessels -- a record that wasn't broken until the harbour was dredged."),
    ("english_contractions", "I'm sure they'll say it's fine, but we'd've known; you're right, THEY'RE WRONG. It'S O'Brien's."),
    ("dutch",
     "Het is vandaag echt hondenweer in Utrecht: de fietsenstalling staat vol, de grachten zijn grijs en "
     "iedereen drinkt koffie met een stroopwafel erbij. Ruïnes, coördinatie, één, geïnteresseerd."),
    ("german",
     "Die Straße vor dem Rathaus heißt seit 1990 wieder Schloßallee. Größenordnung, Übermaß, "
     "Äpfel und Öfen — ẞ ist das große Eszett. Fußgängerüberweg!"),
    ("french",
     "À l'été, les élèves de la forêt côtière ont préféré le pâté à la crème brûlée ; « Ça va ? » "
     "demanda Noël, déçu. L'œuvre d'Ève était naïve."),
    ("spanish_portuguese", "¿Dónde está la estación? ¡Mañana! Não sei, ação, coração, você também."),
    ("polish_czech_turkish", "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy. Işık ılık süt içer, Ğ ğ Ş ş İ."),
    ("greek", "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Ελληνικά: ά έ ή ί ό ύ ώ ΐ ΰ."),
    ("chinese_simplified",
     "人工智能正在改变我们的生活方式。今天天气很好，我们去公园散步吧！这个模型能不能正确地处理标点符号：“引号”、《书名》……"),
    ("chinese_traditional", "資訊科技與軟體開發：臺灣的繁體中文，還有廣東話「佢哋喺度食緊飯」。"),
    ("japanese", "東京の桜は今年も綺麗に咲きました。カタカナとひらがな、そして漢字を混ぜて書きます。ｶﾀｶﾅ（半角）もあります。"),
    ("korean", "안녕하세요! 오늘은 한국어 토크나이저를 시험하고 있습니다. 빨리빨리, 괜찮아요?"),
    ("russian", "Съешь же ещё этих мягких французских булок, да выпей чаю. Ёжик в тумане; «Привет, мир!»"),
    ("ukrainian", "Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів! Їжак, ґанок, є."),
    ("arabic", "مرحباً بالعالم! اللغة العربية تُكتب من اليمين إلى اليسار، وفيها تشكيل مثل: كَتَبَ الوَلَدُ الدَّرْسَ. ١٢٣٤٥"),
    ("hebrew", "שלום עולם! עִבְרִית נכתבת מימין לשמאל, עם ניקוד לפעמים."),
    ("hindi", "नमस्ते दुनिया! हिन्दी देवनागरी लिपि में लिखी जाती है। क्षत्रिय, ज्ञान, श्रद्धा, ऋषि। १२३"),
    ("bengali_tamil", "আমি বাংলায় গান গাই। தமிழ் ஒரு பழமையான மொழி."),
    ("thai", "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ สวัสดีครับ น้ำใจ ผู้ใหญ่"),
    ("vietnamese", "Tiếng Việt có rất nhiều dấu: ắ ằ ẳ ẵ ặ, ố ồ ổ ỗ ộ. Người Việt Nam."),
    ("georgian_armenian_amharic", "ქართული ენა. Հայերեն լեզու. አማርኛ ቋንቋ።"),
    ("mixed_scripts", "Lily говорит 你好 and مرحبا in one सांस; 3 languages, 1 line."),
    # emoji
    ("emoji_basic", "I ❤️ Rust 🦀 and coffee ☕! 😀😃😄😁 🎉🎊 👍🏽 👋🏿"),
    ("emoji_zwj",
     "Family: 👨‍👩‍👧‍👦, couple: 👩‍❤️‍💋‍👨, technologist: 🧑🏾‍💻, rainbow flag: 🏳️‍🌈, pirate: 🏴‍☠️, polar bear: 🐻‍❄️"),
    ("emoji_flags", "Flags: 🇳🇱 🇩🇪 🇫🇷 🇯🇵 🇰🇷 🇺🇸 🇨🇳 🏴󠁧󠁢󠁳󠁣󠁴󠁿 (Scotland, tag sequence) 🇪🇺"),
    ("emoji_keycaps_new", "Keycaps 1️⃣ #️⃣ *️⃣; newer emoji 🫠 🫨 🩷 🪿 🫎; ©️ ®️ ™️"),
    # code
    ("rust_code",
     "use std::collections::HashMap;\n\n/// Counts words.\npub fn count(text: &str) -> HashMap<&str, usize> {\n"
     "    let mut m = HashMap::new();\n    for w in text.split_whitespace() {\n        *m.entry(w).or_insert(0) += 1;\n"
     "    }\n    m\n}\n\n#[cfg(test)]\nmod tests {\n    #[test]\n    fn it_works() { assert_eq!(super::count(\"a a\")[\"a\"], 2); }\n}\n"),
    ("python_code",
     "def fib(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n    a, b = 0, 1\n"
     "    out = []\n    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n    return out\n\n\n"
     "if __name__ == \"__main__\":\n    print(fib(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n"),
    ("json_code",
     '{\n  "model": "qwen3.6-35b-a3b",\n  "messages": [{"role": "user", "content": "Hi!\\nHow are you?"}],\n'
     '  "temperature": 0.7, "top_p": 0.95, "max_tokens": 32768, "stream": true, "stop": null,\n'
     '  "unicode": "\\u00e9\\ud83d\\ude00", "nested": {"a": [1, 2.5e-3, -4, true, false]}\n}'),
    ("html_css",
     "<!DOCTYPE html>\n<html lang=\"nl\">\n<head><meta charset=\"utf-8\"><title>Lily &amp; co</title>\n"
     "<style>body { margin: 0; font: 14px/1.4 sans-serif; } .x::before { content: \"→\"; }</style></head>\n"
     "<body><p class=\"intro\">Hallo&nbsp;wereld &lt;3</p><!-- comment --></body>\n</html>"),
    ("shell_sql_c",
     "$ cargo test --release -p lily-tokenizer 2>&1 | tee /tmp/log.txt && echo \"ok\"\n"
     "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'J%' ORDER BY id DESC LIMIT 10;\n"
     "int main(void) { char *p = NULL; if (!p) return -1; printf(\"%d\\n\", 0x7fffffff); }"),
    ("regex_and_symbols", r"^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@\w+\.(com|org)$ \\d{3}-\d{4} ~!@#$%^&*()_+-=[]{}|;':\",./<>?"),
    ("markdown_latex",
     "# Title\n\n* item **bold** _it_ `code`\n1. first\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
     "$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}$$ and $\\alpha_i \\le \\beta^{(k)}$."),
    # whitespace
    ("whitespace_runs", "a  b   c    d     e\n\n\nf\t\tg \t h   \n   \n\n    indented\n        more"),
    ("tabs_only", "\t\t\t\n\tx\t\n\t \t \t"),
    ("crlf", "line one\r\nline two\r\n\r\nline four\r\n  indented\r\n\rlone cr\rend\n"),
    ("long_spaces", "x" + " " * 50 + "y" + "\n" * 7 + " " * 17),
    ("leading_trailing_ws", "   leading and trailing   "),
    ("unicode_spaces", "nbsp\u00a0here, em\u2003space, thin\u2009space, ideographic\u3000space, zwsp\u200bhere, line\u2028sep, bom\ufeffx"),
    ("single_space", " "),
    ("single_newline", "\n"),
    ("empty", ""),
    # numbers
    ("numbers",
     "0 1 12 123 1234 12345 123456789012345678901234567890 3.14159265358979 -42 +7 1e-10 6.022e23 "
     "1,000,000.00 0x1F 0b1010 ½ ¾ ² ³ ⅓ Ⅻ ①②③ ٣ ๓ 四 ４２"),
    ("dates_money", "2026-05-17T08:30:00Z, €12,50, $1,299.99, ¥10000, £3.50, 25°C, 99.9%, 1/2/3"),
    # chat / special tokens
    ("chatml_rendered", RENDERED_CHAT),
    ("chatml_no_think", "<|im_start|>user\nhoi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHallo!<|im_end|>\n<|endoftext|>"),
    ("special_adjacent", "<|im_end|><|im_start|><|im_end|><think></think><tool_call></tool_call><|endoftext|>"),
    ("special_in_words", "a<think>b</think>c<|im_start|>d<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>z<|vision_start|><|image_pad|><|vision_end|>"),
    ("special_lookalikes", "<|im_start <|IM_START|> <think > </ think> <|im_end|| <tool_call <|unknown|> |im_end|>"),
    ("special_with_spaces", "  <|im_start|>  user \n <think>  \n</think> \t<tool_response>\n ok \n</tool_response>  "),
    ("all_added_tokens", None),  # filled in below from tokenizer.json
    # normalisation (NFC normaliser): NFD / compatibility singletons compose or map
    ("nfc_latin", "café naïve résumé Ångström"),
    ("nfd_latin", unicodedata.normalize("NFD", "café naïve résumé Ångström")),
    ("nfd_vietnamese", unicodedata.normalize("NFD", "Tiếng Việt: người, được, những")),
    ("nfd_hangul", unicodedata.normalize("NFD", "한국어 정규화")),
    ("nfc_singletons", "Angstrom sign \u212b, ohm sign \u2126, Kelvin \u212a, CJK compat \uf900\uf901, e\u0301\u0302 stacked"),
    ("combining_marks", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u0334\u0335\u031c\u0330\u0354L\u0368\u0364\u0367\u0347G\u031a\u0350 o\u0308\u0332 q\u0323\u0307 a\u0303\u0301"),
    ("jamo_and_fullwidth", "\u1100\u1161\u11a8 ᄀ ㄱ ＡＢＣ ﬁ ﬀ ㍻ ㎏ ℌ"),
    # odd characters
    ("controls_and_escapes", "bell\x07 esc\x1b[31mred\x1b[0m nul\x00x del\x7f tab\tvt\x0bff\x0c end"),
    ("replacement_char_and_privateuse", "bad \ufffd byte, private \ue000\U000f0000, noncharacter \ufdd0, max \U0010fffd"),
    ("rtl_bidi_marks", "abc\u200fdef\u200eghi \u202eevil\u202c \u2066iso\u2069"),
    ("long_s_contraction", "it'ſ the ſame, ſ'S, don\u2019t, DON'T, dON't, we'Ve, I'M, y'ALL, they'D"),
    ("newer_unicode_letters", "Kawi \U00011f04\U00011f05\U00011f06, Nag Mundari \U0001e4d0\U0001e4d1, CJK ext-H \U00031350, Egyptian \U00013000"),
    ("repeated_chars", "a" * 120 + " " + "=" * 80 + " " + "ha" * 40 + " " + "😀" * 12 + " " + "啊" * 30),
    ("url_email_path", "https://example.com/a/b?c=1&d=%20x#frag mailto:lily@example.nl C:\\Users\\lily\\file.txt ~/.cargo/bin"),
]


def random_pieces(n=150, seed=20260517):
    """Seeded random strings: ASCII, code points below U+32000 (most scripts, CJK, emoji) and anywhere
    (unassigned, private use, planes 14-16); no surrogates. These probe the regex's Unicode tables
    (onig in Python vs fancy-regex/regex in Rust) and invalid-looking byte sequences."""
    import random

    rng = random.Random(seed)

    def rc():
        r = rng.random()
        if r < 0.3:
            return chr(rng.randrange(32, 127))
        c = rng.randrange(0, 0x32000) if r < 0.6 else rng.randrange(0, 0x110000)
        return "A" if 0xD800 <= c < 0xE000 else chr(c)

    return [(f"random_{i:03}", "".join(rc() for _ in range(rng.randint(1, 30)))) for i in range(n)]


def tokenizer_config(tok_json):
    """A Qwen-style tokenizer_config.json for the transformers cross-check and the Rust tests."""
    added = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok_json["added_tokens"]
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def check_cli(lily, model_dir, tok, texts):
    """Runs `lily tokenize` on every (name, text); returns the number of failures."""
    bad = 0
    for name, text in texts:
        want = tok.encode(text, add_special_tokens=False).ids
        want_text = tok.decode(want, skip_special_tokens=False)
        r = subprocess.run([lily, "tokenize", "--model", str(model_dir)], input=text.encode("utf-8"),
                           capture_output=True)
        try:
            got = json.loads(r.stdout) if r.returncode == 0 else None
        except json.JSONDecodeError:
            got = None
        r2 = subprocess.run([lily, "tokenize", "--model", str(model_dir), "--decode"],
                            input=json.dumps(want).encode(), capture_output=True)
        got_text = r2.stdout.decode("utf-8", errors="replace") if r2.returncode == 0 else None
        ok_ids, ok_text = got == want, got_text == want_text
        if not (ok_ids and ok_text):
            bad += 1
            print(f"FAIL {name}: ids {'ok' if ok_ids else 'DIFFER'}, decode {'ok' if ok_text else 'DIFFERS'}"
                  f"{'' if r.returncode == 0 else ' (encode rc %d: %s)' % (r.returncode, r.stderr.decode()[-300:])}"
                  f"{'' if r2.returncode == 0 else ' (decode rc %d: %s)' % (r2.returncode, r2.stderr.decode()[-300:])}")
            if got is not None and not ok_ids:
                print(f"  got  {got[:40]}\n  want {want[:40]}")
            if got_text is not None and not ok_text:
                print(f"  got  {got_text[:200]!r}\n  want {want_text[:200]!r}")
    n_ids = sum(len(tok.encode(t, add_special_tokens=False).ids) for _, t in texts)
    print(f"lily tokenize: {len(texts) - bad}/{len(texts)} texts give the reference ids and decode back "
          f"({n_ids} ids)")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(ROOT / "assets/qwen3.6-tokenizer.json.gz"))
    ap.add_argument("--out-dir", default=str(ROOT / "crates/lily-tokenizer/tests/data"))
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers cross-check")
    ap.add_argument("--lily", help="check this `lily` binary's `tokenize` subcommand instead of writing files")
    ap.add_argument("--model", help="with --lily: a checkpoint directory (its tokenizer.json is the reference)")
    ap.add_argument("--corpus", help="with --lily: a UTF-8 text file; its paragraphs and the whole file are checked")
    args = ap.parse_args()

    if args.model:
        raw = (Path(args.model) / "tokenizer.json").read_bytes()
    else:
        raw = Path(args.tokenizer).read_bytes()
        if args.tokenizer.endswith(".gz"):
            raw = gzip.decompress(raw)
    tok_json = json.loads(raw)
    tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    corpus = []
    for name, text in CORPUS:
        if text is None:  # every added token once, separated by spaces and words
            text = " x ".join(t["content"] for t in tok_json["added_tokens"])
        corpus.append((name, text))
    corpus += random_pieces()
    names = [n for n, _ in corpus]
    assert len(set(names)) == len(names), "duplicate piece names"

    if args.lily:
        if args.corpus:
            whole = Path(args.corpus).read_text(encoding="utf-8")
            texts = [(f"{args.corpus}#{i}", t) for i, t in enumerate(whole.split("\n\n")) if t]
            texts.append((args.corpus, whole))
        else:
            texts = [(n, t) for n, t in corpus if not n.startswith("random_")]
            texts.append(("random_all", "\n".join(t for n, t in corpus if n.startswith("random_"))))
        if args.model:
            bad = check_cli(args.lily, Path(args.model), tok, texts)
        else:
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "tokenizer.json").write_bytes(raw)
                (Path(d) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok_json)))
                bad = check_cli(args.lily, Path(d), tok, texts)
        sys.exit(1 if bad else 0)

    pieces = []
    for name, text in corpus:
        ids = tok.encode(text, add_special_tokens=False).ids
        dec = tok.decode(ids, skip_special_tokens=False)
        dec_skip = tok.decode(ids, skip_special_tokens=True)
        # The normaliser is NFC and decoding is byte-exact: decode(encode(x)) == NFC(x).
        assert dec == unicodedata.normalize("NFC", text), (name, dec, text)
        p = {"name": name, "text": text, "ids": ids}
        if dec != text:
            p["decoded"] = dec
        if dec_skip != dec:
            p["decoded_skip_special"] = dec_skip
        pieces.append(p)

    # README known ids
    known = {
        "readme_known_1": [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933,
                           128, 97, 91914, 28495, 68933, 128, 105, 68933, 128, 95],
        "readme_known_2": [248045, 846, 198, 5834, 248046, 198, 248068, 198],
    }
    for p in pieces:
        if p["name"] in known:
            assert p["ids"] == known[p["name"]], (p["name"], p["ids"])

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tokenizer_config(tok_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    versions = {"tokenizers": tokenizers.__version__}
    if not args.no_transformers:
        import transformers

        versions["transformers"] = transformers.__version__
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "tokenizer.json").write_bytes(raw)
            (Path(d) / "tokenizer_config.json").write_text(json.dumps(cfg))
            at = transformers.AutoTokenizer.from_pretrained(d)
            bad = 0
            for p in pieces:
                ids = at.encode(p["text"], add_special_tokens=False)
                dec = at.decode(p["ids"], skip_special_tokens=False)
                dec_skip = at.decode(p["ids"], skip_special_tokens=True)
                want_dec = p.get("decoded", p["text"])
                want_skip = p.get("decoded_skip_special", want_dec)
                if ids != p["ids"] or dec != want_dec or dec_skip != want_skip:
                    bad += 1
                    print(f"transformers disagrees on {p['name']}: ids {ids == p['ids']}, "
                          f"decode {dec == want_dec}, skip {dec_skip == want_skip}", file=sys.stderr)
            assert at.eos_token_id == 248046 and at.pad_token_id == 248044 and at.bos_token_id is None
            assert len(at) == vocab_size, (len(at), vocab_size)
            print(f"transformers {transformers.__version__} AutoTokenizer ({type(at).__name__}): "
                  f"{len(pieces) - bad}/{len(pieces)} pieces agree")
            if bad:
                sys.exit(1)

            # A real checkpoint directory: config.json says model_type qwen3_5_moe and the Hub's
            # tokenizer_config.json may say tokenizer_class "Qwen2Tokenizer". transformers 5 then loads
            # Qwen3_5Tokenizer, which rebuilds the pipeline from its own defaults (same regex as
            # tokenizer.json): it must agree too.
            cfg2 = dict(cfg, tokenizer_class="Qwen2Tokenizer")
            (Path(d) / "tokenizer_config.json").write_text(json.dumps(cfg2))
            (Path(d) / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
            at2 = transformers.AutoTokenizer.from_pretrained(d)
            diff = [p["name"] for p in pieces if at2.encode(p["text"], add_special_tokens=False) != p["ids"]
                    or at2.decode(p["ids"]) != p.get("decoded", p["text"])]
            print(f"transformers AutoTokenizer on a qwen3_5_moe dir with tokenizer_class=Qwen2Tokenizer "
                  f"({type(at2).__name__}): {len(pieces) - len(diff)}/{len(pieces)} pieces agree")
            if diff:
                print(f"  differ: {diff}", file=sys.stderr)
                sys.exit(1)

            # Informational pitfall: without config.json, tokenizer_class "Qwen2Tokenizer" makes
            # transformers 5 rebuild the pipeline with the Qwen2 regex (no \p{M}), which splits
            # combining marks differently (Hindi, Thai, Arabic harakat, ZWJ emoji...).
            os.remove(Path(d) / "config.json")
            at3 = transformers.AutoTokenizer.from_pretrained(d)
            diff = [p["name"] for p in pieces if at3.encode(p["text"], add_special_tokens=False) != p["ids"]]
            print(f"  (info) bare dir with tokenizer_class=Qwen2Tokenizer ({type(at3).__name__}, Qwen2 regex): "
                  f"{len(pieces) - len(diff)}/{len(pieces)} agree; differ: {diff}")

    golden = dict(versions, vocab_size=vocab_size, pieces=pieces)
    text = json.dumps(golden, ensure_ascii=False, indent=None, separators=(",", ":"))
    # one piece per line keeps diffs readable
    text = text.replace('},{"name"', '},\n{"name"')
    (out_dir / "golden.json").write_text(text + "\n", encoding="utf-8")
    n_ids = sum(len(p["ids"]) for p in pieces)
    print(f"wrote {out_dir / 'golden.json'}: {len(pieces)} pieces, {n_ids} ids, "
          f"{(out_dir / 'golden.json').stat().st_size} bytes; vocab_size {vocab_size}")


if __name__ == "__main__":
    main()
