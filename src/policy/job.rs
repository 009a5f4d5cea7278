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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
}

impl JobState {
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
        };
        assert_eq!(
            job_id(&spec, br#"{"job":{"id":"j_1"}}"#),
            Some("j_1".into())
        );
        assert_eq!(job_id(&spec, br#"{"job":{"id":7}}"#), Some("7".into()));
        assert_eq!(job_id(&spec, br#"{"job":{}}"#), None);
        assert_eq!(job_id(&spec, b"not json"), None);
    }
}
