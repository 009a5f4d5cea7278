"""Sign a webhook delivery with a provider's reference library, for tests/webhooks.rs.

    python tests/webhook_sign.py standard|stripe SECRET EVENT_ID UNIX_TIMESTAMP < BODY

prints the signed headers as one JSON object. `standard` signs with PyPI `standardwebhooks`
(`Webhook.sign`), `stripe` with stripe-python's `WebhookSignature.generate_signature_header`.
When the timestamp is current, the library's own verifier checks the signature first
(`Webhook.verify`, `Webhook.construct_event`), so the proxy is tested against signatures
the reference implementation itself accepts.
"""

import json
import sys
import time
from datetime import datetime, timezone


def main() -> None:
    scheme, secret, event_id, ts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    body = sys.stdin.buffer.read().decode("utf-8")
    fresh = abs(time.time() - ts) < 240
    if scheme == "standard":
        from standardwebhooks.webhooks import Webhook

        wh = Webhook(secret)
        sig = wh.sign(event_id, datetime.fromtimestamp(ts, tz=timezone.utc), body)
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": sig,
        }
        if fresh:
            wh.verify(body, headers)
    elif scheme == "stripe":
        import stripe

        header = stripe.WebhookSignature.generate_signature_header(body, secret, timestamp=ts)
        if fresh:
            stripe.Webhook.construct_event(body, header, secret)
        headers = {"Stripe-Signature": header}
    else:
        raise SystemExit(f"unknown scheme {scheme}")
    print(json.dumps(headers))


if __name__ == "__main__":
    main()
