"""Engine servers and their HTTP clients: the embedded CPU engine behind SGLang's native
API (`embedded`), the proxy's client (`client`, `connections`) and a scripted engine
that answers from a playbook (`scripted`)."""
