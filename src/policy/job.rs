//! Background jobs (SPEC section 9.2): a call that answers `202` + a job id starts work
//! that ends later. The job's state lives on the call's record beside its execution state
//! (the record stays `committed`: its answer, the `202`, is history); [`advance`] is the one
//! place that decides how a job's state may move.

use serde::{Deserialize, Serialize};

/// `job:` on a side-effect route.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// JSON pointer to the job id in the committed answer.
    pub id: String,
    /// How the job's state is read from the upstream (observed polls, proactive polling).
    pub status: Option<StatusSpec>,
}

/// `job.status`: the upstream's read-only status endpoint of a job.
#[derive(Clone, Debug)]
pub struct StatusSpec {
    pub method: http::Method,
    /// Path template relative to the upstream, as route paths are; `{job_id}` is the job's
    /// id, other parameters come from the starting call's own path parameters.
    pub path: String,
    /// JSON pointer to the job's state in a status answer.
    pub state: String,
    pub succeeded: Vec<String>,
    pub failed: Vec<String>,
    /// Proactive polling period; `None`: only the agent's own polls are observed.
    pub every: Option<std::time::Duration>,
}

impl StatusSpec {
    /// What a status answer's body says: `Some(end)` when its state is in one of the lists.
    pub fn ended(&self, body: &[u8]) -> Option<(JobState, serde_json::Value)> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let state = match v.pointer(&self.state)? {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::Bool(b) => b.to_string(),
            _ => return None,
        };
        let to = if self.succeeded.contains(&state) {
            JobState::Succeeded
        } else if self.failed.contains(&state) {
            JobState::Failed
        } else {
            return None;
        };
        Some((to, v))
    }

    /// The status path for one job: `{job_id}` and the starting call's path parameters
    /// filled in (each percent-encoded as a path segment).
    pub fn render(&self, job_id: &str, params: &[(String, String)]) -> Result<String, String> {
        let mut out = String::with_capacity(self.path.len() + job_id.len());
        let mut rest = self.path.as_str();
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed parameter in {}", self.path))?
                + open;
            let name = &rest[open + 1..close];
            let value = if name == JOB_ID_PARAM {
                job_id
            } else {
                params
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_str())
                    .ok_or_else(|| format!("the starting call has no path parameter `{name}`"))?
            };
            out.extend(percent_encoding::utf8_percent_encode(value, SEGMENT));
            rest = &rest[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// The `job.status` endpoints one read-only route carries: a request of the agent's own
/// that matches one of them is observed on its way back (SPEC section 9.2).
#[derive(Debug)]
pub struct JobWatch {
    /// Status path template → indices into `watchers`.
    router: matchit::Router<Vec<usize>>,
    pub watchers: Vec<Watcher>,
}

/// A side-effect route whose jobs' status a read-only route carries.
#[derive(Debug, Clone)]
pub struct Watcher {
    /// The side-effect route that starts the jobs.
    pub route: String,
    pub status: StatusSpec,
}

impl JobWatch {
    pub fn new(watchers: Vec<Watcher>) -> Result<JobWatch, String> {
        let mut templates: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, w) in watchers.iter().enumerate() {
            match templates.iter_mut().find(|(t, _)| *t == w.status.path) {
                Some((_, v)) => v.push(i),
                None => templates.push((w.status.path.clone(), vec![i])),
            }
        }
        let mut router = matchit::Router::new();
        for (t, v) in templates {
            router.insert(t, v).map_err(|e| e.to_string())?;
        }
        Ok(JobWatch { router, watchers })
    }

    /// The watchers a request (`method`, its path relative to the mount) is a status poll
    /// of, with the job id it names.
    pub fn matching<'a>(
        &'a self,
        method: &http::Method,
        rel_path: &str,
    ) -> Option<(String, Vec<&'a Watcher>)> {
        let m = self.router.at(rel_path).ok()?;
        let job_id = m.params.get(JOB_ID_PARAM)?;
        let job_id = percent_encoding::percent_decode_str(job_id)
            .decode_utf8()
            .ok()?
            .into_owned();
        let ws: Vec<&Watcher> = m
            .value
            .iter()
            .map(|&i| &self.watchers[i])
            .filter(|w| w.status.method == method)
            .collect();
        (!ws.is_empty()).then_some((job_id, ws))
    }
}

/// The parameter of a `job.status` path that names the job.
pub const JOB_ID_PARAM: &str = "job_id";

/// What may not appear raw in one path segment.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// What ended a job, kept on the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndedBy {
    /// A correlated webhook event (9.1).
    Webhook,
    /// The agent's own status request, observed as it passed through.
    ObservedPoll,
    /// The proxy's own polling (`job.status.every`).
    Poll,
}

impl EndedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            EndedBy::Webhook => "webhook",
            EndedBy::ObservedPoll => "observed_poll",
            EndedBy::Poll => "poll",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
}

impl JobState {
    pub const ALL: [JobState; 3] = [JobState::Running, JobState::Succeeded, JobState::Failed];

    /// Stable small integer for on-disk indexes (never reorder).
    pub fn code(self) -> u8 {
        match self {
            JobState::Running => 0,
            JobState::Succeeded => 1,
            JobState::Failed => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
        }
    }
}

impl std::str::FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "running" => Ok(JobState::Running),
            "succeeded" => Ok(JobState::Succeeded),
            "failed" => Ok(JobState::Failed),
            other => Err(format!(
                "unknown job state `{other}` (expected running, succeeded or failed)"
            )),
        }
    }
}

/// A job's move: only a running job ends, and it ends once. An event that would move an
/// ended job (a late or repeated delivery) is refused, never an overwrite.
pub fn advance(from: JobState, to: JobState) -> Result<JobState, String> {
    match (from, to) {
        (JobState::Running, JobState::Succeeded | JobState::Failed) => Ok(to),
        _ => Err(format!(
            "a {} job cannot become {}",
            from.as_str(),
            to.as_str()
        )),
    }
}

/// End `job` (the one place a job's state is written after it started): `advance` decides
/// whether it may move; the result, what ended it and when are kept with the move.
pub fn end(
    job: &mut crate::store::record::Job,
    to: JobState,
    result: serde_json::Value,
    event: Option<String>,
    by: EndedBy,
    now_ms: i64,
) -> Result<(), String> {
    job.state = advance(job.state, to)?;
    job.result = Some(result);
    job.event = event;
    job.ended_by = Some(by);
    job.updated_at_ms = now_ms;
    Ok(())
}

/// The job id in a committed answer's body (a string or a number at the pointer).
pub fn job_id(spec: &JobSpec, body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    match v.pointer(&spec.id)? {
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_ends_once() {
        use JobState::*;
        for (from, to, ok) in [
            (Running, Succeeded, true),
            (Running, Failed, true),
            (Running, Running, false),
            (Succeeded, Failed, false),
            (Failed, Succeeded, false),
            (Succeeded, Succeeded, false),
        ] {
            assert_eq!(advance(from, to).is_ok(), ok, "{from:?} -> {to:?}");
        }
        assert_eq!("failed".parse(), Ok(Failed));
        assert!("done".parse::<JobState>().is_err());
    }

    #[test]
    fn the_job_id_comes_from_the_answer() {
        let spec = JobSpec {
            id: "/job/id".into(),
            status: None,
        };
        assert_eq!(
            job_id(&spec, br#"{"job":{"id":"j_1"}}"#),
            Some("j_1".into())
        );
        assert_eq!(job_id(&spec, br#"{"job":{"id":7}}"#), Some("7".into()));
        assert_eq!(job_id(&spec, br#"{"job":{}}"#), None);
        assert_eq!(job_id(&spec, b"not json"), None);
    }

    #[test]
    fn status_answers_end_jobs_and_paths_are_filled() {
        let spec = StatusSpec {
            method: http::Method::GET,
            path: "/accounts/{acct}/jobs/{job_id}".into(),
            state: "/status".into(),
            succeeded: vec!["done".into()],
            failed: vec!["failed".into(), "cancelled".into()],
            every: None,
        };
        assert_eq!(
            spec.ended(br#"{"status":"done","out":1}"#).map(|e| e.0),
            Some(JobState::Succeeded)
        );
        assert_eq!(
            spec.ended(br#"{"status":"cancelled"}"#).map(|e| e.0),
            Some(JobState::Failed)
        );
        assert_eq!(spec.ended(br#"{"status":"running"}"#), None);
        assert_eq!(spec.ended(b"nope"), None);
        let params = vec![("acct".to_string(), "a 1".to_string())];
        assert_eq!(
            spec.render("j/7", &params),
            Ok("/accounts/a%201/jobs/j%2F7".to_string())
        );
        assert!(spec.render("j", &[]).is_err());
        let codes: std::collections::HashSet<u8> = JobState::ALL.iter().map(|s| s.code()).collect();
        assert_eq!(codes.len(), 3);
    }
}
