"""The P/D router in front of vLLM servers: `python -m kvflow_tools.routing.router`.

`router` (the HTTP front), `legs` (what P and D are sent, and how: both at once, or P then
D), `relay` (answers to
the client as they arrive), `first_token` (a first token sent from P's answer and D's stream
checked against it), `backends` (least-loaded selection and health checks), `http_limits`
(bounds on what a client can make it hold), `limit_options` (their command-line options),
`shares` (which connections give way at a cap, and each client address's share).  P and D
hosts need none of it: vLLM loads only the connector (`kvflow.integrations.vllm`).
"""
