"""Front-end language programs against a running radixserve server.

    serve run serve_config.yaml                        # one shell: the Ray Serve app on :8000
    python examples/frontend_qa.py [http://127.0.0.1:8000]

(serve_config.yaml serves SmolLM2-135M-Instruct: small, so expect short, simple answers.)
"""
import sys

import frontend as sgl


@sgl.function
def qa(s, question):
    s += sgl.system("You answer in one short sentence.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, stop="\n"))


@sgl.function
def triage(s, question):
    s += sgl.user(f"Is this question about the sea or about numbers? {question}")
    s += sgl.assistant(sgl.select("topic", choices=["The sea.", "Numbers."]))


@sgl.function
def tips(s, topic):
    s += f"Three tips about {topic}:\n"
    forks = s.fork(3)  # three branches, generated in parallel from one cached prefix
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("tip", max_tokens=16, stop="\n")
    forks.join()
    for i, f in enumerate(forks):
        s += f"{i + 1}.{f['tip']}\n"


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))

    state = qa.run(question="What is the capital of France?", temperature=0)
    print("answer:", repr(state["answer"]), state.get_meta_info("answer"))

    questions = ["Where does the river run?", "How many days has a week?", "Why is the sea salty?"]
    for q, s in zip(questions, triage.run_batch([{"question": q} for q in questions])):
        print(f"topic of {q!r}: {s['topic']}  (scores {s.get_meta_info('topic')['normalized_logprobs']})")

    print(tips.run(topic="lighthouses", temperature=0.8).text())

    print("streamed: ", end="")
    for piece in qa.run(question="Can you tell me a story?", stream=True).text_iter("answer"):
        print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
