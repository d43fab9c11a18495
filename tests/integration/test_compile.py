"""PT2_COMPILE (SPEC §7): the compiled forward is warmed up at startup, then serves without recompiling."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engines.compiled import compiled_graphs
from tests.fixtures.adapters import write_lora, write_raw_prefix
from tests.integration import reference
from tests.integration.harness import ServerThread
from tgis.openmp import GIL_SWITCH_INTERVAL
from tgis.pb import generation_pb2 as pb

PROMPTS = ("Hi", "The quick brown fox jumps over the lazy dog again and again", "naïve café 👍🏽", "x " * 20)


@pytest.mark.slow
def test_compiled_server_answers_like_transformers_without_recompiling(model_dirs, tmp_path):
    model_dir = model_dirs("gpt2")
    prefix = reference._load(model_dir)[0].get_input_embeddings().weight.detach()[10:13].clone()
    write_raw_prefix(tmp_path, "prefix", decoder=prefix)
    write_lora(tmp_path, "lora", model_dir, seed=1)
    server = ServerThread(
        model_dir,
        pt2_compile=True,
        ready_timeout=600,  # the warm-up compiles every graph before the server starts
        max_batch_size=4,
        max_sequence_length=64,
        max_new_tokens=16,
        prefix_store_path=str(tmp_path),
    )
    try:
        warmed = compiled_graphs()
        assert warmed > 0  # the forward really went through torch.compile at startup
        assert server.engine.spec.paged  # compiled around the paged attention function
        # Its steps are whole graphs (the CPU kernels' operators), so the GIL changes hands sooner.
        assert server.engine.spec.whole_graph_steps
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL)

        def generate(text: str, new_tokens: int, adapter_id: str = "") -> pb.GenerationResponse:
            request = pb.BatchedGenerationRequest(
                adapter_id=adapter_id,
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=new_tokens)),
                requests=[pb.GenerationRequest(text=text)],
            )
            return server.stub.Generate(request, timeout=300).responses[0]

        cases = [(text, new_tokens, a) for text in PROMPTS for new_tokens in (1, 7) for a in ("", "prefix")]
        with ThreadPoolExecutor(len(cases)) as pool:  # mixed batch sizes, prefixes, joins and prunes
            answers = list(pool.map(lambda case: generate(*case), cases))
        for (text, new_tokens, adapter_id), answer in zip(cases, answers, strict=True):
            expected = (
                reference.greedy_with_prefix(model_dir, text, new_tokens, decoder=prefix)
                if adapter_id
                else reference.greedy(model_dir, text, new_tokens)
            )
            assert answer.text == expected.text
            assert answer.generated_token_count == expected.generated_token_count
        assert compiled_graphs() == warmed, "serving compiled a shape the warm-up missed"
        assert server.engine.exported_steps > 0  # the fused steps ran from the AOTInductor package
        with pytest.raises(grpc.RpcError) as raised:
            generate(PROMPTS[0], 2, "lora")
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == (
            "can't retrieve prompt prefix with id 'lora': LoRA adapters are not supported with PT2_COMPILE"
        )
    finally:
        server.stop()


def test_an_eager_server_keeps_pythons_gil_switch_interval(model_dirs):
    """Only steps compiled whole take the short interval: an eager step holds the GIL for most of its
    length, and there the loop's earlier turns cost more than they save (tgis/openmp.py)."""
    before = sys.getswitchinterval()
    server = ServerThread(model_dirs("gpt2"), max_batch_size=2, max_sequence_length=64, max_new_tokens=4)
    try:
        assert not server.engine.spec.whole_graph_steps
        assert sys.getswitchinterval() == before
        assert before != pytest.approx(GIL_SWITCH_INTERVAL)
    finally:
        server.stop()
