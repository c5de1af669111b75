"""A stand-in for an SGLang server with EAGLE-3 chain speculation, on a real HTTP socket (127.0.0.1).

SGLang cannot run on these machines (docs/verify.md: "SGLang on this CPU"), so its side of the contract
is pinned here from its source: the endpoints ``eaglekit verify`` uses (``/get_model_info``,
``/get_server_info``, ``/generate`` with ``input_ids``) and the ``meta_info`` fields of
``tokenizer_manager._calculate_spec_decoding_metrics`` (``spec_verify_ct``, ``spec_accept_length`` =
completion_tokens / spec_verify_ct, ``spec_accept_histogram``). Decoding is eaglekit's own loop with the
target in-process; the aux layers come from the draft folder's ``eagle_config`` the way SGLang's
``llama.py`` maps them (+1 to each id), so a wrong config.json serves badly here as it would there.
"""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from support.json_http import JsonHandler


class FakeSglang:
    def __init__(self, target_dir: Path, draft_dir: Path, k: int):
        from transformers import AutoModelForCausalLM

        from eaglekit.drafters.eagle3.checkpoint import load_drafter

        self.target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.drafter, _ = load_drafter(draft_dir)
        raw = json.loads((draft_dir / "config.json").read_text())
        self.aux = [i + 1 for i in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # llama.py's rule
        self.draft_dir, self.k = draft_dir, k
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def generate(self, body: dict) -> dict:
        from eaglekit.drafters.eagle3.proposer import EagleProposer
        from eaglekit.speculative.decode import generate

        params = body["sampling_params"]
        assert params["temperature"] == 0.0 and "input_ids" in body
        with self.lock:
            out = generate(
                self.target,
                body["input_ids"],
                params["max_new_tokens"],
                proposer=EagleProposer(self.drafter, self.aux),
                k=self.k,
                stop_ids=set(params.get("stop_token_ids") or []),
                engine_accounting=True,
            )
        histogram = [0] * (self.k + 1)
        for accepted in out.accepted_per_round:
            histogram[accepted] += 1
        rounds = out.stats.rounds
        return {
            "text": "",
            "output_ids": out.tokens,
            "meta_info": {
                "completion_tokens": len(out.tokens),
                "spec_verify_ct": rounds,
                "spec_accept_length": len(out.tokens) / rounds if rounds else 0.0,
                "spec_accept_histogram": histogram,
                "finish_reason": {"type": "stop"},
            },
        }

    def _handler(self):
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path == "/get_model_info":
                    return self.send_json(200, {"model_path": "tiny", "is_generation": True})
                if self.path == "/get_server_info":
                    return self.send_json(
                        200,
                        {
                            "speculative_algorithm": "EAGLE3",
                            "speculative_num_steps": fake.k,
                            "speculative_eagle_topk": 1,
                            "speculative_num_draft_tokens": fake.k + 1,
                            "speculative_draft_model_path": str(fake.draft_dir),
                        },
                    )
                self.send_json(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/generate":
                    return self.send_json(200, fake.generate(body))
                self.send_json(404, {"error": "not found"})

        return Handler

    def __enter__(self) -> FakeSglang:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
