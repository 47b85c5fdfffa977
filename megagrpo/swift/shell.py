"""Read the ``swift rlhf`` / ``megatron rlhf`` command out of a shell script, without running
or expanding anything from it (used by `megagrpo from-swift`).

A small lexer for the shell a launch script uses: line continuations, ``'...'``, ``"..."``
(over several lines too), ``$'...'`` (ANSI-C escapes), comments, ``;``/``&&`` separators and
``VAR=value`` assignments. ``$VAR`` / ``${VAR}`` are replaced by a value the script assigned
earlier from literals; anything else the shell would compute (``$(...)``, backticks, a
variable the script does not set, an arithmetic expansion) is left as written and the word is
marked :class:`Unexpanded`, which from-swift reports as untranslatable instead of mapping it.

Expansion is bounded: a script whose variables expand to more than :data:`MAX_EXPANDED`
characters in all (``V2="$V1$V1"`` doubles the text each line: 39 lines made 18 GB) is a
ConfigError naming the line.
"""

from __future__ import annotations

from megagrpo.errors import ConfigError

MAX_EXPANDED = 8 << 20
"""Characters all ``$VAR`` expansions of one script may produce together."""

ANSI_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a"}


class Unexpanded(str):
    """A word whose value only the shell could compute (``$(nproc)``, ``$HOME``, ...): the
    text as written."""


class _Lexer:
    def __init__(self, text: str, variables: dict[str, str]) -> None:
        self.text, self.i, self.vars = text, 0, variables
        self.dynamic = False
        self.expanded = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def _unclosed(self, start: int, what: str) -> ConfigError:
        """The error for a quote or bracket opened at ``start`` that never closes."""
        line = self.text.count("\n", 0, start) + 1
        return ConfigError(f"script line {line}: no closing {what}")

    def _quoted_char(self, start: int, close: str, what: str) -> str | None:
        """The next character inside the quote opened at ``start`` (consumed); None at
        ``close``."""
        c = self.peek()
        if not c:
            raise self._unclosed(start, what)
        self.i += 1
        return None if c == close else c

    def _until(self, close: str, start: int) -> str:
        j = self.text.find(close, self.i)
        if j < 0:
            raise self._unclosed(start, repr(close))
        out, self.i = self.text[self.i : j], j + len(close)
        return out

    def _balanced(self, start: int) -> str:
        """``$(...)`` / ``$((...))``: the text up to the matching ')', marked dynamic."""
        depth, j = 0, self.i
        while j < len(self.text):
            c = self.text[j]
            depth += c == "("
            depth -= c == ")"
            j += 1
            if depth == 0:
                break
        else:
            raise self._unclosed(start, "')' of $(")
        out, self.i = self.text[self.i - 1 : j], j  # from the '$'
        self.dynamic = True
        return out

    def dollar(self) -> str:
        """After a '$': a variable, a command substitution or a literal '$'."""
        start = self.i - 1
        c = self.peek()
        if c == "(":
            return self._balanced(start)
        if c == "{":
            self.i += 1
            name = self._until("}", start)
            return self._var(name, "${" + name + "}")
        j = self.i
        while j < len(self.text) and (self.text[j].isalnum() or self.text[j] == "_"):
            j += 1
        if j == self.i:
            if c and c in "@*#?$!0123456789-":
                self.i += 1
                self.dynamic = True
                return "$" + c
            return "$"
        name, self.i = self.text[self.i : j], j
        return self._var(name, "$" + name)

    def _var(self, name: str, written: str) -> str:
        if name in self.vars and not isinstance(self.vars[name], Unexpanded):
            value = self.vars[name]
            self.expanded += len(value)
            if self.expanded > MAX_EXPANDED:
                line = self.text.count("\n", 0, self.i) + 1
                raise ConfigError(
                    f"script line {line}: ${name} makes the script's variables expand to over "
                    f"{MAX_EXPANDED >> 20} MiB of text (a variable that doubles itself?): "
                    "from-swift reads launch scripts, not this"
                )
            return value
        self.dynamic = True
        return written

    def double_quoted(self, start: int) -> str:
        out = []
        while (c := self._quoted_char(start, '"', "'\"'")) is not None:
            if c == "\\" and self.peek() in ('"', "\\", "$", "`", "\n"):
                nxt = self.peek()
                self.i += 1
                out.append("" if nxt == "\n" else nxt)
            elif c == "$":
                out.append(self.dollar())
            elif c == "`":
                out.append("`" + self._until("`", self.i - 1) + "`")
                self.dynamic = True
            else:
                out.append(c)
        return "".join(out)

    def ansi_c(self, start: int) -> str:
        out = []
        while (c := self._quoted_char(start, "'", "\"'\" of $'")) is not None:
            if c == "\\" and self.peek():
                nxt = self.peek()
                self.i += 1
                out.append(ANSI_ESCAPES.get(nxt, "\\" + nxt))
            else:
                out.append(c)
        return "".join(out)


def shell_commands(text: str, exported: dict[str, str] | None = None) -> list[list[str]]:
    """The script's simple commands, each a list of words (:class:`Unexpanded` where the shell
    would compute the value). Assignment-only commands (and ``export VAR=value ...``) are
    applied to later words; ``exported`` collects the ``export``-ed ones, as the environment
    of later commands (``export VAR`` exports a variable assigned before)."""
    variables: dict[str, str] = {}
    commands: list[list[str]] = []
    words: list[str] = []
    lex = _Lexer(text, variables)
    out = exported if exported is not None else {}

    def assign(w: str, export: bool) -> None:
        key, eq, value = w.partition("=")
        if not eq:  # export VAR
            if key in variables:
                out[key] = variables[key]
            return
        variables[key] = Unexpanded(value) if isinstance(w, Unexpanded) else value
        if export:
            out[key] = variables[key]

    def end_command() -> None:
        nonlocal words
        export = bool(words) and words[0] == "export"
        rest = words[1:] if export else words
        if rest and all(_assignment(w) or (export and w.isidentifier()) for w in rest):
            for w in rest:
                assign(w, export)
        elif words and not export:
            commands.append(words)
        words = []

    while lex.i < len(text):
        c = lex.peek()
        if c == "\\" and lex.peek(1) == "\n":
            lex.i += 2
        elif c in " \t\r":
            lex.i += 1
        elif c in "\n;&|":
            lex.i += 1
            end_command()
        elif c == "#":
            j = text.find("\n", lex.i)
            lex.i = len(text) if j < 0 else j
        else:
            words.append(_word(lex))
    end_command()
    return commands


def _word(lex: _Lexer) -> str:
    """One word from the lexer's position (quotes and expansions joined)."""
    out: list[str] = []
    lex.dynamic = False
    while lex.i < len(lex.text):
        c = lex.peek()
        if c in " \t\r\n;&|" or (c == "\\" and lex.peek(1) == "\n"):
            break
        start = lex.i
        lex.i += 1
        if c == "'":
            out.append(lex._until("'", start))
        elif c == '"':
            out.append(lex.double_quoted(start))
        elif c == "$" and lex.peek() == "'":
            lex.i += 1
            out.append(lex.ansi_c(start))
        elif c == "$":
            out.append(lex.dollar())
        elif c == "`":
            out.append("`" + lex._until("`", start) + "`")
            lex.dynamic = True
        elif c == "\\" and lex.peek():
            out.append(lex.peek())
            lex.i += 1
        else:
            out.append(c)
    word = "".join(out)
    return Unexpanded(word) if lex.dynamic else word


def _assignment(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and name.isidentifier()


ENTRY_POINTS = {
    "swift.cli.rlhf": "swift",
    "swift.cli._megatron.rlhf": "megatron",
    "swift/cli/rlhf.py": "swift",
    "swift/cli/_megatron/rlhf.py": "megatron",
}
"""ms-swift's rlhf entry points as a module (``python -m``) or a script path, by front end."""
TORCHRUN_ENV = {"nproc_per_node": "NPROC_PER_NODE", "nnodes": "NNODES"}


def _entry_point(word: str) -> str | None:
    """The front end of an ms-swift entry point word (``swift.cli.rlhf``,
    ``/x/swift/cli/_megatron/rlhf.py``, ...), else None."""
    for suffix, flavor in ENTRY_POINTS.items():
        if word == suffix or word.endswith("/" + suffix):
            return flavor
    return None


def is_rlhf_command(words: list[str]) -> bool:
    """``swift rlhf``, ``megatron rlhf``, or an rlhf entry point run by python / torchrun."""
    return "rlhf" in words or any(_entry_point(w) for w in words)


def read_launcher(tokens: list[str], i: int) -> tuple[int, str | None, dict[str, str]]:
    """From ``tokens[i]`` (after the leading assignments) to the first ms-swift flag:
    ``(index of that flag, front end or None, environment the launcher implies)``. Takes
    ``swift``/``megatron`` ``rlhf``, ``python[3] -m swift.cli[._megatron].rlhf``, a path to
    ``swift/cli/[_megatron/]rlhf.py`` and ``torchrun`` with its options (``--nproc_per_node``
    and ``--nnodes`` become NPROC_PER_NODE / NNODES; options the shell computes,
    ``$DISTRIBUTED_ARGS``, become TORCHRUN, which from-swift reports); ConfigError on anything
    else."""
    flavor, env = None, {}
    torchrun = False
    while i < len(tokens):
        word = tokens[i]
        entry = _entry_point(word)
        if word.startswith("--") and not torchrun:
            break
        if entry:
            flavor, torchrun = entry, False
        elif word in ("swift", "megatron"):
            flavor = word
        elif word.rsplit("/", 1)[-1] == "torchrun":
            torchrun = True
        elif torchrun and isinstance(word, Unexpanded):  # torchrun $DISTRIBUTED_ARGS ...
            env["TORCHRUN"] = word
        elif torchrun and word.startswith("-"):
            name, eq, value = word.lstrip("-").partition("=")
            name = name.replace("-", "_")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                i, value = i + 1, tokens[i + 1]
            if name in TORCHRUN_ENV:
                env[TORCHRUN_ENV[name]] = value
        elif word.rsplit("/", 1)[-1] not in ("rlhf", "python", "python3", "-m"):
            raise ConfigError(f"unexpected word {word!r} before the first --flag")
        i += 1
    return i, flavor, env


def command_from_script(text: str) -> list[str]:
    """The words of the script's ``swift rlhf`` / ``megatron rlhf`` command (or an rlhf entry
    point run by ``python -m`` / ``torchrun``), preceded by ``VAR=value`` words for the
    variables the script ``export``-ed before it (the command's own leading assignments,
    which follow, take precedence)."""
    exported: dict[str, str] = {}
    for words in shell_commands(text, exported):
        if is_rlhf_command(words):
            lead = [_assign(k, v) for k, v in exported.items()]
            return lead + words
    raise ConfigError(
        "no 'swift rlhf', 'megatron rlhf' or 'python -m swift.cli.rlhf' command in the script"
    )


def _assign(key: str, value: str) -> str:
    word = f"{key}={value}"
    return Unexpanded(word) if isinstance(value, Unexpanded) else word
