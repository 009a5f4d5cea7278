// Drives the operator console in real headless Chromium (Debian's `chromium`), the way an
// operator would: sign in with the token, find the pending call, check its preview, click
// Approve, look the execution up, filter the executions list and open it from a link. Run by tests/console.rs, which makes the pending call
// and afterwards checks that its retry executes exactly once.
//
// Environment: ADMIN_URL, ADMIN_TOKEN, EXECUTION_ID, BATCH_ID (an independent batch), EXPECT_PREVIEW (text the card must
// show), OPERATION_ID (the calls' operation, for the timeline), ANSWERED_ID (a committed
// call, for its stored answer), JOB_EXECUTION_ID and JOB_ID (optional: a call whose job
// succeeded, for the jobs view and the record's job), CHROMIUM (default /usr/bin/chromium), SCREENSHOT (optional
// PNG path).
// Exits non-zero, with the reason, on any failure; a missing browser is a failure.
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const need = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const adminUrl = need("ADMIN_URL");
const token = need("ADMIN_TOKEN");
const executionId = need("EXECUTION_ID");
const expectPreview = process.env.EXPECT_PREVIEW || "";
const executable = process.env.CHROMIUM || "/usr/bin/chromium";
const screenshot = process.env.SCREENSHOT || "";

if (!existsSync(executable)) {
  console.error(`chromium not found at ${executable}: install it (apt-get install -y chromium)`);
  process.exit(2);
}

const profile = mkdtempSync(join(tmpdir(), "idemproxy-console-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: executable,
  headless: true,
  viewport: { width: 1280, height: 900 },
  args: [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
});
const problems = [];
try {
  const page = context.pages()[0] || (await context.newPage());
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  page.on("console", (m) => {
    if (m.type() === "error") problems.push(`console error: ${m.text()}`);
  });
  page.on("dialog", (d) => d.accept());

  await page.goto(`${adminUrl}/`);
  // A wrong token is refused with a message and the sign-in form stays.
  await page.fill("#token", `${token}-wrong`);
  await page.click("#login-form button[type=submit]");
  await page.waitForSelector("#login-error:has-text('refused')");
  problems.length = 0; // the browser reports that refused call as a console error

  await page.fill("#token", token);
  await page.fill("#operator", "console-test");
  await page.click("#login-form button[type=submit]");
  const card = page.locator(`#approvals-list article[data-id="${executionId}"]`);
  await card.waitFor({ timeout: 10_000 });
  const text = await card.innerText();
  if (expectPreview && !text.includes(expectPreview)) {
    throw new Error(`the pending card does not show ${expectPreview}: ${text}`);
  }
  await page.waitForSelector("#metrics-body tr[data-route]");
  await page.waitForSelector("#unknown-list article");
  await page.waitForSelector("#executions-result table.executions");
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });

  await card.locator('button[data-action="approve"]').click();
  await page.waitForSelector(`#message:has-text("Approved ${executionId}")`);
  await card.waitFor({ state: "detached", timeout: 10_000 });

  // Search by execution id shows it approved, by the name given at sign-in.
  await page.fill("#search-id", executionId);
  await page.click("#search-form button[type=submit]");
  await page.waitForSelector(`#detail .state.approved`);
  const detail = await page.locator("#detail").innerText();
  if (!detail.includes("by console-test")) throw new Error(`approval author not shown: ${detail}`);

  // A batch's page lists its items with their states; an item's page links back to it.
  const batchId = need("BATCH_ID");
  await page.fill("#search-id", batchId);
  await page.click("#search-form button[type=submit]");
  await page.waitForSelector(`#detail article[data-id="${batchId}"] .batch-items`);
  const items = await page.locator("#detail .batch-items").innerText();
  if (!items.includes("2 committed, 0 unknown, 0 not sent")) {
    throw new Error(`batch items not shown: ${items}`);
  }
  await page.locator("#detail .batch-items a").nth(1).click();
  await page.waitForSelector(`#detail article:not([data-id="${batchId}"])`);
  const item = await page.locator("#detail").innerText();
  if (!item.includes(`item 1 of ${batchId}`)) throw new Error(`item's batch not shown: ${item}`);

  // A committed call's page shows its stored answer decoded: headers as a table, the
  // JSON body pretty-printed.
  const answered = need("ANSWERED_ID");
  await page.fill("#search-id", answered);
  await page.click("#search-form button[type=submit]");
  await page.waitForSelector(`#detail article[data-id="${answered}"] pre.body.json`);
  const body = await page.locator("#detail pre.body.json").innerText();
  if (!body.includes('\n  "') || !body.includes('"object": "message"')) {
    throw new Error(`stored answer not pretty-printed JSON: ${body}`);
  }
  if (!(await page.locator("#detail table.headers th:has-text('content-type')").count())) {
    throw new Error("stored answer headers not shown as a table");
  }

  // The operation's timeline lists its calls in the order they were made; a click opens one.
  await page.fill("#timeline-op", need("OPERATION_ID"));
  await page.click("#timeline-form button[type=submit]");
  await page.waitForSelector("#timeline-result table.timeline tbody tr");
  const order = await page.locator("#timeline-result tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.id));
  if (order.length !== 3 || order[0] !== executionId || order[2] !== answered) {
    throw new Error(`timeline not in call order: ${order}`);
  }
  await page.locator(`#timeline-result tr[data-id="${answered}"] button`).click();
  await page.waitForSelector(`#detail article[data-id="${answered}"]`);

  // The jobs view lists the ended job by state; a click opens its call with the job.
  const jobExec = process.env.JOB_EXECUTION_ID;
  if (jobExec) {
    await page.selectOption("#jobs-state", "succeeded");
    const row = page.locator(`#jobs-list tr[data-id="${jobExec}"]`);
    await row.waitFor({ timeout: 10_000 });
    const rowText = await row.innerText();
    if (!rowText.includes(need("JOB_ID")) || !rowText.includes("observed poll")) {
      throw new Error(`job row does not show the job and what ended it: ${rowText}`);
    }
    await row.locator("button").click();
    await page.waitForSelector(`#detail article[data-id="${jobExec}"] .job-state.succeeded`);
    const jobDetail = await page.locator("#detail").innerText();
    if (!jobDetail.includes("Background job") || !jobDetail.includes(".csv")) {
      throw new Error(`the record's page does not show its job and result: ${jobDetail}`);
    }
  }

  // The executions list filters by what the calls were made with; the filters live in the
  // page's address, so the same link shows the same list.
  const listed = () => page.locator("#executions-result tbody tr")
    .evaluateAll((rows) => rows.map((r) => r.dataset.id).sort());
  const rowsAre = (n) => page.waitForFunction(
    (n) => document.querySelectorAll("#executions-result tbody tr").length === n, n);
  await page.fill("#filter-form input[name=upstream]", "pay");
  await page.click("#filter-form button[type=submit]");
  await rowsAre(2);
  if (!new URL(page.url()).searchParams.get("upstream")) {
    throw new Error(`the filter is not in the address: ${page.url()}`);
  }
  const pay = await listed();
  if (!pay.includes(executionId)) throw new Error(`upstream=pay lists ${pay}`);
  await page.goto(page.url());
  await rowsAre(2);
  if ((await page.inputValue("#filter-form input[name=upstream]")) !== "pay") {
    throw new Error("a linked view does not fill the form");
  }
  if (JSON.stringify(await listed()) !== JSON.stringify(pay)) {
    throw new Error(`a linked view lists ${await listed()}, not ${pay}`);
  }
  await page.fill("#filter-form input[name=upstream]", "");
  await page.fill("#filter-form input[name=key]", "k-mail");
  await page.click("#filter-form button[type=submit]");
  await page.waitForSelector(`#executions-result tr[data-id="${answered}"]`);
  await rowsAre(1);
  await page.fill("#filter-form input[name=until]", "2001-01-01T00:00:00");
  await page.click("#filter-form button[type=submit]");
  await page.waitForSelector("#executions-result:has-text('No execution matches')");
  await page.click("#filter-clear");
  await page.waitForFunction(() => location.search === "");

  if (problems.length) throw new Error(problems.join("\n"));
  console.log(`console test passed: approved ${executionId} by clicking`);
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
