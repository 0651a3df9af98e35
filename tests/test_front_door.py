"""What a new user meets first: bad input costs only itself, vLLM's import line, the CLI."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxsched import SchedulerConfig, TraceError, parse_trace
from jaxsched.engine.params import SamplingParams
from models.gguf import find_smollm2_gguf
from models.llama import LlamaConfig, LlamaForCausalLM
from models.tokenizer import Tokenizer

ENGINE = dict(block_size=4, num_slots=16, max_seqs_per_group=4, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=48, num_device_blocks=64,
              num_host_blocks=64, attention_impl="reference")


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return Tokenizer.from_gguf_file(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def llm(tokenizer):
    """A tiny random model on SmolLM2's tokenizer: real text and chat, compiled in seconds."""
    from jaxsched import LLM
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=256)
    return LLM(LlamaForCausalLM(config, nnx.Rngs(0)), tokenizer=tokenizer, **ENGINE)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _idle(llm) -> bool:
    return not llm.has_unfinished() and not llm.num_queued()


# ----------------------------------------------------------------------------- requests


def test_generate__an_overlong_prompt_is_ignored_alone_and_the_others_return(llm):
    outs = llm.generate(["good one", "hello " * 100, "good two"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 0, 4]
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "ignored"
    assert "max_model_len=48" in outs[1].message and "tokens" in outs[1].message
    assert _idle(llm)
    # The same prompts one by one give the same tokens: the bad one changed nothing.
    alone = llm.generate(["good two"], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_front_ends_agree_on_an_overlong_prompt(llm):
    long = [1] * 60
    streamed = [o for o in llm.generate_stream([[5, 6], long], GREEDY)]
    ignored = [o for o in streamed if o.outputs[0].finish_reason == "ignored"]
    assert len(ignored) == 1 and ignored[0].message
    llm.add_request("long-by-hand", long, GREEDY)
    out = llm.output("long-by-hand")
    assert out.finished and out.outputs[0].finish_reason == "ignored"
    chat = llm.chat([{"role": "user", "content": "word " * 80}], GREEDY)
    assert chat.outputs[0].finish_reason == "ignored" and "max_model_len" in chat.message
    assert _idle(llm)


@pytest.mark.parametrize("prompts, params, match", [
    (["a", "b", "c"], [GREEDY, GREEDY], "2 given for 3 prompts"),
    (["a", None], GREEDY, r"prompts\[1\]: must be a string"),
    (["a", []], GREEDY, r"prompts\[1\]: must have at least one token"),
    (["a", [1, 10**9]], GREEDY, r"prompts\[1\]: token ids must be in \[0, vocab_size"),
    (["a", [1.5]], GREEDY, r"prompts\[1\]: token ids must be integers"),
    (["a", "b"], [GREEDY, "greedy"], "sampling_params: must be a SamplingParams"),
    (["a", "b"], [GREEDY, SamplingParams(n=9)], "max_num_seqs=8"),
    (None, GREEDY, "prompts: must be"),
])
def test_generate__a_malformed_batch_is_rejected_whole_with_nothing_queued(llm, prompts, params, match):
    before = len(llm._processor.requests)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert len(llm._processor.requests) == before and _idle(llm)


def test_generate__vllms_prompt_token_ids_and_get_tokenizer(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode("Hello"), tok.encode("The sky is")]
    by_ids = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    by_text = llm.generate(["Hello", "The sky is"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in by_text]
    assert [o.prompt_token_ids for o in by_ids] == ids
    with pytest.raises(ValueError, match="prompt_token_ids: give prompts or prompt_token_ids, not both"):
        llm.generate(["Hello"], GREEDY, prompt_token_ids=ids)
    with pytest.raises(ValueError, match=r"prompts\[1\]: must have at least one token"):
        llm.generate(prompt_token_ids=[ids[0], []], sampling_params=GREEDY)
    assert _idle(llm)


PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_chat_template__per_call_per_engine_and_from_a_file(llm, tokenizer, tmp_path, capsys):
    from jaxsched import LLM
    from jaxsched.entrypoints import cli
    conv = [{"role": "user", "content": "Hi"}]
    out = llm.chat(conv, GREEDY, chat_template=PLAIN_TEMPLATE)
    assert out.prompt_token_ids == tokenizer.encode("[user] Hi\n", add_special_tokens=False)
    assert llm.chat(conv, GREEDY).prompt_token_ids != out.prompt_token_ids      # the model's own, still
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128)
    own = LLM(LlamaForCausalLM(config, nnx.Rngs(0)), tokenizer=tokenizer, chat_template=str(path),
              num_device_blocks=8, num_host_blocks=8, max_model_len=64, max_num_batched_tokens=64)
    assert own.chat(conv, GREEDY).prompt_token_ids == out.prompt_token_ids
    assert tokenizer.chat_template != PLAIN_TEMPLATE                             # the caller's untouched
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    with pytest.raises(ValueError, match="messages: the chat template refused them: a system message must come first"):
        llm.chat(conv, GREEDY, chat_template=strict)
    for bad, why in (("no-such-template", "neither a file nor a Jinja chat template"),
                     ("{% for m in messages %}", "does not compile")):
        with pytest.raises(ValueError, match=f"chat_template: .*{why}"):
            llm.chat(conv, GREEDY, chat_template=bad)
        assert cli.main(["generate", "--chat-template", bad]) == 2               # before the model loads
        assert "--chat-template: " in capsys.readouterr().err


def test_server_chat__a_template_refusal_is_a_400_naming_messages(tokenizer):
    """The server renders chats as LLM.chat does: a template's raise_exception is the client's
    to fix (a 400 naming messages), not the server's failure."""
    import copy
    import types
    pytest.importorskip("fastapi")
    from jaxsched.entrypoints.openai_server import ApiError, OpenAIServer
    from jaxsched.entrypoints.protocol import ChatMessage
    tok = copy.copy(tokenizer)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    server = types.SimpleNamespace(_tokenizer=lambda: tok)
    with pytest.raises(ApiError) as refused:
        OpenAIServer._chat_ids(server, [ChatMessage(role="user", content="x")], True)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "refused them: roles must alternate" in refused.value.message


def test_chat__a_list_of_conversations_returns_a_list(llm):
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    outs = llm.chat(convs, GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    one = llm.chat(convs[1], GREEDY)
    assert one.outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[1\]: must be a non-empty list"):
        llm.chat([convs[0], [{"role": "user"}]], GREEDY)


def test_llm__max_model_len_beyond_the_models_context_is_rejected_with_both_numbers(tokenizer):
    from jaxsched import LLM
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128)
    with pytest.raises(ValueError, match="max_model_len: 100000 .* context length 128"):
        LLM(LlamaForCausalLM(config, nnx.Rngs(0)), tokenizer=tokenizer, max_model_len=100000)


def test_llm__vllm_dtype_names_and_flags_as_vllm_code_passes_them(tokenizer):
    from jaxsched import LLM
    for bad in ("float16", "bogus"):
        with pytest.raises(ValueError, match=f"dtype: must be one of .*got '{bad}'"):
            LLM("/nonexistent/model.gguf", dtype=bad)             # before the model loads
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128)
    llm = LLM(LlamaForCausalLM(config, nnx.Rngs(0)), tokenizer=tokenizer, dtype="auto", enforce_eager=True,
              trust_remote_code=True, num_device_blocks=8, num_host_blocks=8, max_model_len=64,
              max_num_batched_tokens=64)
    assert llm.model_config.dtype == "float32"


def test_llm__bad_engine_arguments_fail_before_the_model_loads():
    from jaxsched import LLM
    # A model path that does not exist: the config error must come first.
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM("/nonexistent/model.gguf", preemption_mode="bogus")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("/nonexistent/model.gguf", max_num_seqs=0)


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field, value", [
    ("n", None), ("n", 0), ("n", 1.5), ("temperature", None), ("temperature", float("nan")),
    ("temperature", -1), ("top_p", None), ("top_p", 0.0), ("top_p", 2), ("top_p", "x"),
    ("top_k", None), ("top_k", -5), ("top_k", 1.0), ("min_p", None), ("min_p", 1.5),
    ("seed", "7"), ("seed", -1), ("seed", 2**31), ("max_tokens", None), ("max_tokens", 0),
    ("max_tokens", True), ("min_tokens", None), ("min_tokens", 99), ("stop_token_ids", None),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", list(range(9))), ("ignore_eos", None),
    ("ignore_eos", "yes"), ("logprobs", 21), ("logprobs", -1), ("logprobs", "1"),
    ("stop", "".join([])), ("stop", [None]), ("presence_penalty", 2.5), ("frequency_penalty", None),
    ("repetition_penalty", 0),
])
def test_sampling_params__every_bad_field_gets_one_line_naming_it(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}: ") and "\n" not in message


def test_sampling_params__engine_limits_are_named():
    with pytest.raises(ValueError, match="max_seqs_per_group=4"):
        SamplingParams(n=5).validate(max_num_seqs=8, max_seqs_per_group=4)
    with pytest.raises(ValueError, match="max_model_len=32"):
        SamplingParams(max_tokens=33).validate(max_model_len=32)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


# ----------------------------------------------------------------------------- imports


def test_import__vllms_first_line_works():
    import jaxsched
    from jaxsched import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: F401
    assert callable(jaxsched.sweep) and jaxsched.sweep.__module__ == "jaxsched.sim.sweep"


def test_config__default_spells_vllms_default_mode():
    assert SchedulerConfig(preemption_mode="default").preemption_mode is None
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="bogus")


# ----------------------------------------------------------------------------- traces


def _trace(config=None, requests=None):
    return {"config": {"num_device_blocks": 16, **(config or {})},
            "requests": [{"id": "a", "prompt_len": 8, "max_tokens": 4}] if requests is None else requests}


@pytest.mark.parametrize("trace, field", [
    (_trace({"step_time": "fast"}), "step_time"),
    (_trace({"max_steps": None}), "max_steps"),
    (_trace(requests=[]), "requests"),
    (_trace({"num_device_blocks": 10**12}), "num_device_blocks"),
    (_trace({"enable_chunked_prefill": "yes"}), "enable_chunked_prefill"),
    (_trace({"preemption_mode": 3}), "preemption_mode"),
    (_trace(requests=[{"id": "a", "prompt_len": 10**9, "max_tokens": 1}]), "prompt_len"),
])
def test_trace__bad_fields_are_named(trace, field):
    with pytest.raises(TraceError, match=field):
        parse_trace(trace)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats()
                    | st.text(max_size=5), lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=5)
CONFIG_FIELDS = ["block_size", "num_device_blocks", "num_host_blocks", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill",
                 "preemption_mode", "preemption_costs", "delay_factor", "watermark", "step_time",
                 "max_steps", "artificial_preemption", "seed"]
REQUEST_FIELDS = ["id", "arrival_step", "prompt_len", "max_tokens", "n"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=st.dictionaries(st.sampled_from(CONFIG_FIELDS), JSON, max_size=4),
       requests=st.lists(st.dictionaries(st.sampled_from(REQUEST_FIELDS), JSON, max_size=5),
                         max_size=3) | JSON,
       top=st.dictionaries(st.sampled_from(["config", "requests", "extra"]), JSON, max_size=1))
def test_trace__no_json_value_reaches_a_traceback(config, requests, top):
    for data in ({"config": config, "requests": requests}, {**top}, requests, config):
        try:
            trace = parse_trace(data)
        except TraceError as e:
            assert "\n" not in str(e)
        else:
            assert trace.requests and trace.step_time > 0 and trace.max_steps >= 1


def test_simulate_cli__config_without_host_blocks_replays_and_bad_fields_exit_2(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"config": {"num_device_blocks": 16, "block_size": 4},
                                "requests": [{"id": "a", "prompt_len": 8, "max_tokens": 4}]}))
    done = subprocess.run([sys.executable, "-m", "jaxsched.entrypoints.cli", "simulate", str(good),
                           "--compilation-cache-dir", "off"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "peak_host_blocks_used" in done.stdout
    for config, field in (({"step_time": "fast"}, "step_time"), ({"max_steps": None}, "max_steps")):
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps(_trace(config)))
        done = subprocess.run([sys.executable, "-m", "jaxsched.entrypoints.cli", "simulate", str(bad)],
                              capture_output=True, text=True)
        assert done.returncode == 2 and field in done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_simulate_cli__a_prefix_caching_trace_replays_on_the_jitted_path_as_vllm_did(tmp_path):
    """`jaxsched simulate` replays a caching trace on the jitted scheduler (SPEC A10), with
    vLLM's decisions on a prefix-* golden, and no longer hands it to the reference."""
    from goldens import GOLDEN_DIR, assert_replays_golden
    name = "prefix-default-vllm-default-t001"
    path = GOLDEN_DIR / f"{name}.trace.json"
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "jaxsched.entrypoints.cli", "simulate", str(path),
                           "--output", str(out), "--compilation-cache-dir", "off"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "reference" not in done.stdout
    assert_replays_golden(name, json.loads(out.read_text()))


# ----------------------------------------------------------------------------- CLI


def _walk(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, (*path, name))
        else:
            yield path, parser, action


def test_cli__every_flag_of_every_subcommand_has_help_and_shows_its_default():
    from jaxsched.entrypoints.cli import build_parser
    parser = build_parser()
    assert "scheduler" in parser.description and "vLLM" in parser.description
    seen = set()
    for path, owner, action in _walk(parser):
        seen.add(path)
        if action.dest == "help" or not path:
            continue
        assert action.help, f"jaxsched {' '.join(path)} {action.option_strings}: no help text"
        assert owner.formatter_class is argparse.ArgumentDefaultsHelpFormatter, path
    assert {("generate",), ("simulate",), ("sweep",), ("trace", "generate")} <= seen


@pytest.mark.parametrize("argv, match", [
    (["generate", "--max-tokens", "0"], "SamplingParams.max_tokens"),
    (["generate", "--preemption-mode", "bogus"], "preemption_mode"),
    (["generate", "--top-p", "2"], "SamplingParams.top_p"),
    (["generate", "--n", "9"], "max_num_seqs=8"),
])
def test_cli__bad_flags_exit_2_before_the_model_loads(argv, match, capsys, monkeypatch):
    from jaxsched.entrypoints import cli
    import jaxsched.entrypoints.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(jaxsched.entrypoints.llm.LLM, "__init__", no_load)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_cli__sweep_range_without_a_step_says_so(tmp_path, capsys):
    from jaxsched.entrypoints import cli
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(_trace()))
    assert cli.main(["sweep", str(trace), "--num-device-blocks", "64:128", "--no-progress"]) == 2
    assert "start:stop:step" in capsys.readouterr().err


def test_cli__preemption_mode_default_is_accepted_by_every_subcommand(tmp_path):
    from jaxsched.entrypoints.cli import build_parser, check_engine_kwargs, engine_kwargs
    args = build_parser().parse_args(["generate", "--preemption-mode", "default"])
    assert check_engine_kwargs(engine_kwargs(args)).preemption_mode is None
    out = tmp_path / "t.json"
    from jaxsched.entrypoints import cli
    assert cli.main(["trace", "generate", "-o", str(out), "--num-requests", "3", "--rate", "1",
                     "--preemption-mode", "default"]) == 0
    assert json.loads(out.read_text())["config"]["preemption_mode"] is None


def test_cli__prefix_caching_and_capacity_flags_reach_the_engine_and_the_sweep(monkeypatch, tmp_path, capsys):
    from jaxsched.entrypoints import cli
    from jaxsched.entrypoints.cli import build_parser, check_engine_kwargs, engine_kwargs
    for sub in ("generate", "serve"):
        args = build_parser().parse_args([sub, "--enable-prefix-caching", "--num-device-blocks", "12",
                                          "--num-device-blocks-capacity", "64"])
        config = check_engine_kwargs(engine_kwargs(args))
        assert config.enable_prefix_caching and config.capacity().num_device_blocks == 64
    seen = {}
    import jaxsched.sim.sweep
    monkeypatch.setattr(jaxsched.sim.sweep, "sweep", lambda trace, **kw: seen.update(kw) or [{"steps": 1}])
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(_trace()))
    assert cli.main(["sweep", str(trace), "--enable-prefix-caching", "false,true", "--no-progress"]) == 0
    assert seen["enable_prefix_caching"] == "false,true"


def test_cli_serve__takes_the_model_as_vllm_serve_does(monkeypatch, capsys):
    """`jaxsched serve MODEL`, as `vllm serve MODEL`: the same as --model; both, differing, exit 2."""
    from jaxsched.entrypoints import cli, openai_server
    seen = []
    monkeypatch.setattr(openai_server, "run_server", lambda args: seen.append(args.model) or 0)
    assert cli.main(["serve", "some/model.gguf", "--port", "9"]) == 0
    assert cli.main(["serve", "--model", "other.gguf"]) == 0
    assert cli.main(["serve", "a.gguf", "--model", "a.gguf"]) == 0
    assert seen == ["some/model.gguf", "other.gguf", "a.gguf"]
    assert cli.main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    assert "the model is given twice" in capsys.readouterr().err and len(seen) == 3


def test_xla_flags__a_users_xla_flags_win_and_the_defaults_are_set_otherwise(monkeypatch):
    from jaxsched.entrypoints.xla_flags import CPU_FLAGS, use_xla_flags
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=somewhere")
    assert use_xla_flags("--extra") == "--xla_dump_to=somewhere"
    monkeypatch.delenv("XLA_FLAGS")
    assert use_xla_flags("--extra").split() == [*CPU_FLAGS, "--extra"]


def test_xla_flags__ours_extend_for_the_sweep_and_never_replace_the_users(monkeypatch, tmp_path, capsys):
    """`jaxsched sweep` adds the GPU command-buffer flags to the CLI's default XLA_FLAGS (a
    GPU-only option: the CPU backend starts with it); a user's XLA_FLAGS are kept as given."""
    from jaxsched.entrypoints import cli, xla_flags
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla_flags.use_xla_flags() == " ".join(xla_flags.CPU_FLAGS)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(_trace()))
    assert cli.main(["sweep", str(trace), "--num-device-blocks", "64:128", "--no-progress"]) == 2
    assert os.environ["XLA_FLAGS"] == " ".join(xla_flags.CPU_FLAGS + xla_flags.SWEEP_GPU_FLAGS)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=somewhere")
    assert cli.main(["sweep", str(trace), "--num-device-blocks", "64:128", "--no-progress"]) == 2
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=somewhere"
    capsys.readouterr()
    env = dict(os.environ, XLA_FLAGS=" ".join(xla_flags.CPU_FLAGS + xla_flags.SWEEP_GPU_FLAGS))
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as j; print(int(j.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr[-2000:]


def test_cli__building_the_parser_imports_no_web_framework():
    """Every `jaxsched` command builds the whole parser, `serve`'s flags included: that must
    not import the server's FastAPI (about 1.3 s of each start)."""
    script = ("import sys\n"
              "from jaxsched.entrypoints.cli import build_parser\n"
              "args = build_parser().parse_args(['serve', '--port', '9'])\n"
              "assert args.port == 9 and callable(args.func)\n"
              "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))\n")
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stdout + got.stderr[-2000:]
