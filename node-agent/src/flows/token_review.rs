//! Who may read this node's flows over TCP: one service account (the
//! operator's, which serves flows.weft.dev), proven by its bound token for
//! the audience `flows.weft.dev`, which the apiserver reviews. A passed
//! review is remembered for a minute, by the token's hash; reviews are
//! asked at most a few a second.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};

/// The audience the operator's projected token is made for.
pub const AUDIENCE: &str = "flows.weft.dev";
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
const REMEMBER: Duration = Duration::from_secs(60);
/// Reviews remembered at most (a caller sending new tokens cannot grow it).
const REMEMBERED: usize = 64;
/// Reviews asked of the apiserver per second at most: the listener is on
/// the node's address, which pods can reach, and a review per made-up
/// token would turn a pod's flood into the apiserver's load. The operator
/// needs one a minute per token.
const REVIEWS_PER_SECOND: u32 = 5;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error("no bearer token")]
    NoToken,
    #[error("the token is not valid for {AUDIENCE}: {0}")]
    NotAuthenticated(String),
    #[error("{0:?} may not read this node's flows")]
    NotTheReader(String),
    #[error("cannot review the token: {0}")]
    Unavailable(String),
}

/// Counts reviews in one-second windows (pure: the caller gives the time).
#[derive(Debug, Default)]
pub struct ReviewBudget {
    window: Option<Instant>,
    used: u32,
}

impl ReviewBudget {
    /// Whether one more review may go to the apiserver at `now`.
    pub fn take(&mut self, now: Instant) -> bool {
        if self.window.is_none_or(|start| now.duration_since(start) >= Duration::from_secs(1)) {
            self.window = Some(now);
            self.used = 0;
        }
        self.used += 1;
        self.used <= REVIEWS_PER_SECOND
    }
}

/// What a review's answer means for `reader` (pure).
pub fn decide(status: Option<&TokenReviewStatus>, reader: &str) -> Result<(), Refused> {
    let status = status.ok_or_else(|| Refused::NotAuthenticated("the review has no status".into()))?;
    if status.authenticated != Some(true) {
        return Err(Refused::NotAuthenticated(status.error.clone().unwrap_or_else(|| "not authenticated".into())));
    }
    if !status.audiences.as_ref().is_some_and(|a| a.iter().any(|a| a == AUDIENCE)) {
        return Err(Refused::NotAuthenticated(format!("not issued for {AUDIENCE}")));
    }
    let user = status.user.as_ref().and_then(|u| u.username.clone()).unwrap_or_default();
    if user != reader {
        return Err(Refused::NotTheReader(user));
    }
    Ok(())
}

/// The bearer token of an `authorization` value.
pub fn bearer(value: Option<&str>) -> Result<&str, Refused> {
    value.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim).filter(|t| !t.is_empty()).ok_or(Refused::NoToken)
}

pub struct TokenReviewer {
    api: Api<TokenReview>,
    reader: String,
    passed: Mutex<HashMap<[u8; 32], Instant>>,
    budget: Mutex<ReviewBudget>,
}

impl TokenReviewer {
    pub fn new(client: kube::Client, reader: String) -> Self {
        TokenReviewer {
            api: Api::all(client),
            reader,
            passed: Mutex::new(HashMap::new()),
            budget: Mutex::new(ReviewBudget::default()),
        }
    }

    /// Ok when `token` is the reader's.
    pub async fn check(&self, token: &str) -> Result<(), Refused> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = Instant::now();
        {
            let passed = self.passed.lock().unwrap_or_else(|p| p.into_inner());
            if passed.get(&key).is_some_and(|until| *until > now) {
                return Ok(());
            }
        }
        if !self.budget.lock().unwrap_or_else(|p| p.into_inner()).take(now) {
            return Err(Refused::Unavailable("too many token reviews this second".into()));
        }
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_owned()), audiences: Some(vec![AUDIENCE.to_owned()]) },
            ..TokenReview::default()
        };
        let answer = tokio::time::timeout(REVIEW_TIMEOUT, self.api.create(&PostParams::default(), &review))
            .await
            .map_err(|_| Refused::Unavailable("the apiserver took too long".into()))?
            .map_err(|e| Refused::Unavailable(e.to_string()))?;
        decide(answer.status.as_ref(), &self.reader)?;
        let mut passed = self.passed.lock().unwrap_or_else(|p| p.into_inner());
        passed.retain(|_, until| *until > now);
        if passed.len() < REMEMBERED {
            passed.insert(key, now + REMEMBER);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;

    const OPERATOR: &str = "system:serviceaccount:weft-system:weft-operator";

    fn status(authenticated: bool, user: &str, audience: &str) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(authenticated),
            audiences: Some(vec![audience.into()]),
            user: Some(UserInfo { username: Some(user.into()), ..UserInfo::default() }),
            error: None,
        }
    }

    #[test]
    fn only_the_readers_token_for_this_audience_passes() {
        decide(Some(&status(true, OPERATOR, AUDIENCE)), OPERATOR).unwrap();
        // A stolen agent token: authenticated, but not the reader.
        let agent = "system:serviceaccount:weft-system:weft-agent";
        assert_eq!(decide(Some(&status(true, agent, AUDIENCE)), OPERATOR), Err(Refused::NotTheReader(agent.into())));
        // The operator's token for the apiserver: not for this audience.
        assert!(matches!(
            decide(Some(&status(true, OPERATOR, "https://kubernetes.default.svc")), OPERATOR),
            Err(Refused::NotAuthenticated(_))
        ));
        assert!(matches!(
            decide(Some(&status(false, OPERATOR, AUDIENCE)), OPERATOR),
            Err(Refused::NotAuthenticated(_))
        ));
        assert!(decide(None, OPERATOR).is_err());
    }

    #[test]
    fn a_flood_of_made_up_tokens_costs_the_apiserver_a_few_reviews_a_second() {
        let mut budget = ReviewBudget::default();
        let t0 = Instant::now();
        let allowed = (0..1000).filter(|_| budget.take(t0)).count();
        assert_eq!(allowed, REVIEWS_PER_SECOND as usize);
        assert!(!budget.take(t0 + Duration::from_millis(999)));
        assert!(budget.take(t0 + Duration::from_secs(1)), "a new second, a new budget");
    }

    #[test]
    fn a_token_comes_only_as_a_bearer() {
        assert_eq!(bearer(Some("Bearer abc")), Ok("abc"));
        assert_eq!(bearer(Some("Basic abc")), Err(Refused::NoToken));
        assert_eq!(bearer(Some("Bearer ")), Err(Refused::NoToken));
        assert_eq!(bearer(None), Err(Refused::NoToken));
    }
}
