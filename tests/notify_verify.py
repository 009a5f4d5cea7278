#!/usr/bin/env python3
"""Verifies notifications the proxy posted (admin.notify) with the Standard Webhooks
reference library. stdin: {"secret": "whsec_...", "messages": [{"headers": {...}, "body": "..."}]}.
Prints one line per message; exits 1 if any signature does not verify."""

import json
import sys

from standardwebhooks.webhooks import Webhook


def main():
    given = json.load(sys.stdin)
    wh = Webhook(given["secret"])
    bad = 0
    for m in given["messages"]:
        try:
            wh.verify(m["body"], m["headers"])
            print(f"ok {m['headers'].get('webhook-id')}")
        except Exception as e:  # the library raises WebhookVerificationError
            bad += 1
            print(f"bad {m['headers'].get('webhook-id')}: {e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
