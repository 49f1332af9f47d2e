//! A scripted API server for reconciler tests: the test answers each
//! request the reconciler makes, after checking it.

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

type Exchange = (Request<Body>, oneshot::Sender<Response<Body>>);

/// The API server's end: each request the client made, with where its
/// answer goes. (A channel rather than tower-test's mock: that crate turns
/// on tokio's `test-util`, which makes every test build compile tokio and
/// all that uses it a second time.)
pub struct Handle(mpsc::UnboundedReceiver<Exchange>);

impl Handle {
    /// The next request, or `None` once every client is gone.
    pub async fn next_request(&mut self) -> Option<Exchange> {
        self.0.recv().await
    }
}

/// A client whose requests the returned handle answers.
pub fn client() -> (kube::Client, Handle) {
    let (requests, handle) = mpsc::unbounded_channel::<Exchange>();
    let service = tower::service_fn(move |request: Request<Body>| {
        let requests = requests.clone();
        async move {
            let (send, answer) = oneshot::channel();
            requests.send((request, send)).map_err(|_| "the scripted API server is gone")?;
            answer.await.map_err(|_| "the scripted API server did not answer")
        }
    });
    (kube::Client::new(service, "default"), Handle(handle))
}

pub fn json_response(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder().status(status).body(Body::from(body.to_string().into_bytes())).expect("response")
}

pub fn ok<T: serde::Serialize>(object: &T) -> Response<Body> {
    json_response(StatusCode::OK, serde_json::to_value(object).expect("json"))
}

pub fn not_found(what: &str) -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": format!("{what} not found"), "reason": "NotFound", "code": 404}),
    )
}

/// Answers the next request after checking its method and path; returns
/// its body, with the query string (if any) under `"query"`.
pub async fn expect(handle: &mut Handle, method: Method, path: &str, answer: Response<Body>) -> Value {
    let (request, send) = handle.next_request().await.expect("the reconciler made no further request");
    assert_eq!(request.method(), method, "{}", request.uri());
    assert_eq!(request.uri().path(), path);
    let query = request.uri().query().unwrap_or_default().to_owned();
    let bytes = request.into_body().collect_bytes().await.expect("request body");
    // The reconciler may have given up waiting: nobody to answer then.
    let _ = send.send(answer);
    let mut body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if !query.is_empty() {
        body["query"] = Value::String(query);
    }
    body
}

/// True when the reconciler made no further request (the mock's senders
/// may be gone with the context, or just idle).
pub async fn no_more_requests(handle: &mut Handle) -> bool {
    matches!(tokio::time::timeout(Duration::from_millis(50), handle.next_request()).await, Err(_) | Ok(None))
}

/// A store holding `objects`, as a reflector would.
pub fn store<K>(objects: impl IntoIterator<Item = K>) -> kube::runtime::reflector::Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = kube::runtime::reflector::store();
    for o in objects {
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(o));
    }
    reader
}

/// Subnet `name` (for node `name`) leasing `cidr`, at resourceVersion `rv`.
pub fn subnet_at(name: &str, cidr: &str, rv: &str) -> weft_api::Subnet {
    let spec = weft_api::SubnetSpec {
        node_name: name.into(),
        cidr: cidr.into(),
        cidrs: Vec::new(),
        backend: weft_api::Backend::Vxlan,
        vni: Some(1),
        mtu: None,
    };
    let mut s = weft_api::Subnet::new(name, spec);
    s.metadata.resource_version = Some(rv.into());
    s
}
