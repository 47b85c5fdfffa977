"""Config defects of red team 4 (shared/reviews/reliability-redteam-4.md, at cabf39c), each
through the user's path (``load_config`` on a YAML file or dotted overrides, or ``megagrpo
train`` itself), each failing on cabf39c:

- N5: ``${ oc.env:S}`` (whitespace OmegaConf accepts) wrote the secret into config.yaml,
  meta.json and W&B. Masking now traces every environment read through OmegaConf's own
  resolver, so every spelling OmegaConf resolves to the secret is masked.
- N7: ``loss.sapo_tau_*`` (and other keys that become float32 math) outside float32 range.
- N14: ``rloo`` / ``reinforce_plus_plus`` with ``budget.advantage_baseline: pool``.
- N19: ``loss.kl_in_reward: true`` with ``kl_coef: 0`` (a silent no-op).
- N18: ``trainer.name`` with control or bidi characters or a leading ``-``.
- Beside the review: an override whose value starts a YAML flow
  (``data.prompt.user_template={question} [x]``) ended in a raw ``yaml.parser.ParserError``.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from megagrpo.config import load_config, to_yaml
from megagrpo.config.loader import _env_interpolations, env_keys, written
from megagrpo.errors import ConfigError
from megagrpo.trainer.config import RunConfig

SECRET = "s3cr3t-Spelling-v4lue"
NAME = "MEGAGRPO_TEST_SECRET"


def _spellings() -> list[str]:
    """Interpolations of the environment variable NAME, in every whitespace placement
    OmegaConf's grammar might take, quoted, built from other keys, nested in resolvers."""
    ws = ["", " ", "\t", "  "]
    forms = [f"${{{a}oc.env{b}:{c}{NAME}{d}}}" for a, b, c, d in itertools.product(ws, repeat=4)]
    forms += [
        f"${{oc.env:'{NAME}'}}",
        f'${{oc.env:"{NAME}"}}',
        f"${{ oc.env : ' {NAME}' }}",  # a quoted name with a space: another variable
        f"${{oc.env:{NAME},fallback}}",
        f"p-${{ oc.env:{NAME} }}-s",
        "${oc.${k}:" + NAME + "}",  # the resolver's name built from another key
        "${${r}:" + NAME + "}",
        "${ oc.env:${n} }",  # the variable's name from another key
        "${oc.decode:${ oc.env:" + NAME + "}}",
        "${oc.create:{a: ${\toc.env:" + NAME + "}}}",
        "${oc.env:UNSET_VARIABLE_7f3a,${ oc.env:" + NAME + "}}",
        "${ indirect }",  # another key that reads it
        "\\${ oc.env:" + NAME + "}",  # escaped: literal text, not the secret
    ]
    return forms


def test_every_spelling_omegaconf_resolves_to_the_secret_is_masked(monkeypatch):
    """N5: each spelling is resolved by OmegaConf itself; wherever that gives the secret,
    the key must be among the environment's (written as its interpolation text)."""
    monkeypatch.setenv(NAME, SECRET)
    helpers = {"k": "env", "r": "oc.env", "n": NAME, "indirect": f"${{ oc.env:{NAME}}}"}
    leaking, refused = [], 0
    for form in _spellings():
        raw = {"v": form, **helpers}
        try:
            value = OmegaConf.create(raw).v
        except Exception:  # noqa: BLE001 - a spelling OmegaConf's grammar refuses
            refused += 1
            continue
        if SECRET in json.dumps(
            OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        ):
            if "v" not in _env_interpolations(raw):
                leaking.append(form)
    assert not leaking, leaking
    assert refused < 100  # most spellings resolve: the test is not vacuous
    assert _env_interpolations({"v": "\\${ oc.env:" + NAME + "}"}) == {}  # literal text


@pytest.mark.parametrize(
    "form",
    [f"${{ oc.env:{NAME}}}", f"${{\toc.env:{NAME}}}", f"${{oc.env :{NAME} }}", "${oc.${k}:N}"],
)
def test_a_spaced_interpolation_never_reaches_what_megagrpo_writes(tmp_path, monkeypatch, form):
    """N5 end to end: the YAML file a user writes; config.yaml's text and the dict every
    checkpoint manifest and W&B get keep the interpolation, the run uses the value."""
    monkeypatch.setenv(NAME, SECRET)
    monkeypatch.setenv("N", SECRET)
    path = tmp_path / "c.yaml"
    section = {
        "wandb_entity": "env",
        "wandb_project": form.replace("${k}", "${metrics.wandb_entity}"),
    }
    path.write_text(yaml.safe_dump({"metrics": section}), encoding="utf-8")
    cfg = load_config(RunConfig, [path])
    assert cfg.metrics.wandb_project == SECRET  # the run uses the value
    assert "metrics.wandb_project" in env_keys(cfg)
    assert SECRET not in to_yaml(cfg) and SECRET not in json.dumps(written(cfg))
    (tmp_path / "again.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    assert load_config(RunConfig, [tmp_path / "again.yaml"]).metrics.wandb_project == SECRET


REJECTED = [
    ("loss.sapo_tau_pos=1e39", "loss.sapo_tau_pos"),  # N7: raw overflow at step 1
    ("loss.sapo_tau_pos=1e-50", "loss.sapo_tau_pos"),  # N7: every step skipped, key unnamed
    ("loss.sapo_tau_neg=1e-4", "loss.sapo_tau_neg"),
    ("loss.sapo_tau_neg=2000", "loss.sapo_tau_neg"),
    ("loss.eps_high=1e39", "loss.eps_high"),  # float32 clamp overflow
    ("loss.tis_cap=1e39", "loss.tis_cap"),
    ("loss.kl_coef=1e39", "loss.kl_coef"),
    ("loss.entropy_coef=-1e39", "loss.entropy_coef"),
    ("loss.kl_coef=1e-45", "loss.kl_coef"),  # rounds to 0 in float32
    ("trainer.lr=1e-50", "trainer.lr"),
    ("trainer.lr=1e39", "trainer.lr"),
    ("model.lora.alpha=1e39", "model.lora.alpha"),
    ("loss.advantage_estimator=rloo,budget.advantage_baseline=pool", "loss.advantage_estimator"),
    (
        "loss.advantage_estimator=reinforce_plus_plus,budget.advantage_baseline=pool",
        "loss.advantage_estimator",
    ),  # N14: crashed at step 1
    ("loss.kl_in_reward=true", "loss.kl_in_reward"),  # N19: kl_coef 0 by default
    ("loss.kl_in_reward=true,loss.kl_coef=0", "loss.kl_in_reward"),
    ('trainer.name="a\\nb"', "trainer.name"),  # N18: YAML's escape, a newline
    ('trainer.name="a\\x1bb"', "trainer.name"),
    ("trainer.name=\u202eevil", "trainer.name"),
    ("trainer.name=-rf", "trainer.name"),
    ("trainer.name=a\u200bb", "trainer.name"),
    ("trainer.name=a\u2028b", "trainer.name"),
]


@pytest.mark.parametrize(("overrides", "key"), REJECTED, ids=[o for o, _ in REJECTED])
def test_rejected_at_load_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, [], overrides.split(","))
    assert f"config key '{key}'" in str(err.value)


ACCEPTED = [
    "loss.sapo_tau_pos=1e-3",
    "loss.sapo_tau_neg=1e3",
    "loss.kl_in_reward=true,loss.kl_coef=0.04",
    "loss.advantage_estimator=rloo",
    "budget.advantage_baseline=pool",
    "trainer.name=run-v2_日本語 a",
    "trainer.lr=1e-7",
]


@pytest.mark.parametrize("overrides", ACCEPTED)
def test_accepted(overrides):
    load_config(RunConfig, [], overrides.split(","))


@pytest.mark.parametrize("tau", [1e-3, 1.0, 1e3, 1e-50, 1e39])
def test_the_sapo_range_is_where_float32_keeps_the_loss_finite(tau):
    """N7's bound against the loss itself (torch, float32): inside it the SAPO surrogate and
    its gradient are finite; the red team's 1e-50 gives -inf / NaN and 1e39 a raw overflow."""
    from megagrpo.algo.config import SAPO_TAU
    from megagrpo.algo.losses import sapo_surrogate

    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.1, -1.9, -0.5, -2.0])
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    try:
        pg, _, _ = sapo_surrogate(logp, old, adv, tau, tau)
        (grad,) = torch.autograd.grad(pg.sum(), logp)
        finite = bool(torch.isfinite(pg).all() and torch.isfinite(grad).all())
    except RuntimeError:  # value cannot be converted to type float without overflow
        finite = False
    assert finite == (SAPO_TAU[0] <= tau <= SAPO_TAU[1])


class _Reached(Exception):
    """build_context was reached with this config."""


def test_an_override_starting_a_yaml_flow_is_taken_as_text(
    tmp_path, monkeypatch, bigram_dir, capsys
):
    """Beside the review: ``data.prompt.user_template={question} [x]`` (YAML reads a flow
    mapping, then fails) ended in a raw ParserError. A string key cannot hold anything but
    text, so the value is taken as written; a number key names the override (exit 2)."""
    import megagrpo.trainer.setup as setup
    from megagrpo.cli import main
    from megagrpo.testing import tiny_run_config, write_run_config

    def reached(cfg, **_):
        raise _Reached(cfg)

    monkeypatch.setattr(setup, "build_context", reached)
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(bigram_dir, tmp_path, "y"))
    template = "{question} [x]\n\n{choices}"
    for override, key, want in (
        (f"data.prompt.user_template={template}", "user_template", template),
        ("data.prompt.system=Answer: A or B", "system", "Answer: A or B"),  # YAML: a mapping
        ("data.prompt.system=[a, b]", "system", "[a, b]"),  # YAML: a list
        ('data.prompt.system="quoted: yes"', "system", "quoted: yes"),  # YAML as before
    ):
        with pytest.raises(_Reached) as got:
            main(["train", str(cfg), override])
        assert getattr(got.value.args[0].data.prompt, key) == want, override
    assert main(["train", str(cfg), "trainer.lr={a} [x]"]) == 2
    err = capsys.readouterr().err
    assert "config key 'trainer.lr'" in err and "not valid YAML" in err and "Traceback" not in err


def test_the_keys_added_since_a_recorded_list_are_listed(tmp_path):
    """The helper for a fuzz of the config keys added this round (tests/unit/config_keys.py):
    the recorded list of cabf39c holds only keys of a schema, and a key missing from a list
    is reported as added."""
    from config_keys import RECORDED, keys_added_since, schema_keys

    keys = schema_keys()
    assert "loss.sapo_tau_pos" in keys and "trainer.name" in keys and "trainer" not in keys
    recorded = RECORDED.read_text(encoding="utf-8").split()
    assert len(recorded) > 150 and recorded == sorted(recorded)
    shorter = tmp_path / "keys.txt"
    shorter.write_text("\n".join(k for k in keys if k != "loss.sapo_tau_neg"), encoding="utf-8")
    assert keys_added_since(shorter) == ["loss.sapo_tau_neg"]
